//! The PNG plot: for each workload a row of two panels, TTFT and
//! inter-token latency, with p50/p90/p99 per policy.
//!
//! With several stages (a rate or concurrency ladder) each panel has one
//! line per policy and percentile over the stages (p50 thick with circles,
//! p90 medium with squares, p99 thin with triangles); with one stage it has
//! grouped bars per policy (p50 dark, p90 lighter, p99 lightest) with their
//! values. Colours name policies in the legend at the top. Drawn with
//! plotters' bitmap backend; all text comes from [`super::font`].

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::font::{draw_text, text_width};
use super::{PolicyResult, Report};
use crate::error::LoadgenError;
use crate::stats::Summary;

const PANEL_W: i32 = 640;
const ROW_H: i32 = 440;
const LEGEND_H: i32 = 60;
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];
const GREY: RGBColor = RGBColor(200, 200, 200);

type Pick = fn(&Summary) -> [Option<f64>; 3];

fn ttft(s: &Summary) -> [Option<f64>; 3] {
    [s.ttft_p50_ms, s.ttft_p90_ms, s.ttft_p99_ms]
}

fn e2e(s: &Summary) -> [Option<f64>; 3] {
    [s.e2e_p50_ms, s.e2e_p90_ms, s.e2e_p99_ms]
}

fn itl(s: &Summary) -> [Option<f64>; 3] {
    [s.itl_p50_ms, s.itl_p90_ms, s.itl_p99_ms]
}

fn size_of(report: &Report) -> (u32, u32) {
    let rows = report.workloads.len().max(1) as i32;
    ((2 * PANEL_W) as u32, (LEGEND_H + rows * ROW_H) as u32)
}

/// Draws `report` into a PNG at `path`.
pub fn write_png(report: &Report, path: &Path) -> Result<(), LoadgenError> {
    let err = |e: String| LoadgenError::Plot {
        path: path.to_path_buf(),
        reason: e,
    };
    let root = BitMapBackend::new(path, size_of(report)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    draw_all(&root, report).map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Draws `report` into memory: RGB bytes, width, height (for tests and
/// callers that encode elsewhere).
pub fn render_rgb(report: &Report) -> Result<(Vec<u8>, u32, u32), LoadgenError> {
    let (w, h) = size_of(report);
    let mut buf = vec![0u8; w as usize * h as usize * 3];
    let err = |e: String| LoadgenError::Plot {
        path: "<memory>".into(),
        reason: e,
    };
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        draw_all(&root, report).map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok((buf, w, h))
}

/// The colour of the i-th policy in plots.
pub fn policy_color(i: usize) -> (u8, u8, u8) {
    let c = PALETTE[i % PALETTE.len()];
    (c.0, c.1, c.2)
}

fn draw_all<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    report: &Report,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    // Legend: one swatch per policy name, in first-seen order.
    let mut names: Vec<&str> = Vec::new();
    for w in &report.workloads {
        for p in &w.policies {
            if !names.contains(&p.policy.as_str()) {
                names.push(&p.policy);
            }
        }
    }
    let mut x = 12;
    for (i, name) in names.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        root.draw(&Rectangle::new([(x, 14), (x + 18, 30)], c.filled()))?;
        draw_text(root, (x + 24, 14), name, 2, &BLACK)?;
        x += 24 + text_width(name, 2) + 24;
    }
    let key = "p50 dark/thick  p90 medium  p99 light/thin   (ms)";
    draw_text(root, (12, 40), key, 1, &BLACK)?;
    let color_of = |p: &PolicyResult| {
        let i = names.iter().position(|n| *n == p.policy).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    };
    for (row, w) in report.workloads.iter().enumerate() {
        let top = LEGEND_H + row as i32 * ROW_H;
        // Non-streaming runs have no TTFT or ITL: show end-to-end latency
        // in the first panel, and say why the second one is empty.
        let has = |pick: Pick| {
            w.policies
                .iter()
                .any(|p| pick(&p.summary).iter().any(Option::is_some))
        };
        let first = if has(ttft) {
            ("TTFT", ttft as Pick)
        } else {
            ("e2e latency", e2e as Pick)
        };
        for (col, (title, pick)) in [first, ("ITL", itl as Pick)].iter().enumerate() {
            let panel = Panel {
                x0: col as i32 * PANEL_W + 70,
                y0: top + 40,
                x1: (col as i32 + 1) * PANEL_W - 20,
                y1: top + ROW_H - 50,
            };
            let heading = format!("{} - {title}", w.name);
            draw_text(root, (panel.x0, top + 12), &heading, 2, &BLACK)?;
            if !has(*pick) {
                let note = "no streaming requests";
                draw_text(
                    root,
                    (panel.x0 + 20, (panel.y0 + panel.y1) / 2),
                    note,
                    2,
                    &GREY,
                )?;
                continue;
            }
            let series: Vec<(RGBColor, &PolicyResult)> =
                w.policies.iter().map(|p| (color_of(p), p)).collect();
            let stages = w.policies.iter().map(|p| p.stages.len()).max().unwrap_or(0);
            if stages > 1 {
                panel.lines(root, &series, *pick)?;
            } else {
                panel.bars(root, &series, *pick)?;
            }
        }
    }
    Ok(())
}

/// A plotting rectangle in pixels.
struct Panel {
    x0: i32,
    y0: i32,
    x1: i32,
    y1: i32,
}

/// A "nice" tick step (1, 2 or 5 × 10^k) giving about five ticks up to `max`.
pub(super) fn tick_step(max: f64) -> f64 {
    let raw = (max / 5.0).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// A tick or bar label: no decimals from 100, one from 1, two below.
pub(super) fn fmt_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn lighten(c: RGBColor, f: f64) -> RGBColor {
    let l = |v: u8| (f64::from(v) + (255.0 - f64::from(v)) * f) as u8;
    RGBColor(l(c.0), l(c.1), l(c.2))
}

impl Panel {
    /// Draws the frame and y grid; returns the y mapping's top value.
    fn axes<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        max: f64,
    ) -> Result<f64, DrawingAreaErrorKind<DB::ErrorType>> {
        let step = tick_step(max);
        let top = (max / step).ceil().max(1.0) * step;
        let mut v = 0.0;
        while v <= top + step / 2.0 {
            let y = self.y(v, top);
            root.draw(&PathElement::new(vec![(self.x0, y), (self.x1, y)], GREY))?;
            let label = fmt_value(v);
            draw_text(
                root,
                (self.x0 - 6 - text_width(&label, 1), y - 4),
                &label,
                1,
                &BLACK,
            )?;
            v += step;
        }
        root.draw(&Rectangle::new(
            [(self.x0, self.y0), (self.x1, self.y1)],
            BLACK,
        ))?;
        Ok(top)
    }

    fn y(&self, v: f64, top: f64) -> i32 {
        self.y1 - ((v / top) * f64::from(self.y1 - self.y0)).round() as i32
    }

    fn max_of(series: &[(RGBColor, &PolicyResult)], pick: Pick, stages: bool) -> f64 {
        let mut max = 0.0f64;
        for (_, p) in series {
            let sums: Vec<&Summary> = if stages {
                p.stages.iter().map(|s| &s.summary).collect()
            } else {
                vec![&p.summary]
            };
            for s in sums {
                max = pick(s).iter().flatten().fold(max, |m, v| m.max(*v));
            }
        }
        if max > 0.0 {
            max * 1.1
        } else {
            1.0
        }
    }

    fn lines<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        series: &[(RGBColor, &PolicyResult)],
        pick: Pick,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        let top = self.axes(root, Self::max_of(series, pick, true))?;
        let n = series
            .iter()
            .map(|(_, p)| p.stages.len())
            .max()
            .unwrap_or(1)
            .max(2);
        let x = |i: usize| self.x0 + 30 + (i as i32 * (self.x1 - self.x0 - 60)) / (n as i32 - 1);
        if let Some((_, p)) = series.iter().max_by_key(|(_, p)| p.stages.len()) {
            for (i, st) in p.stages.iter().enumerate() {
                let w = text_width(&st.label, 1);
                draw_text(root, (x(i) - w / 2, self.y1 + 8), &st.label, 1, &BLACK)?;
            }
        }
        for (color, p) in series {
            for k in 0..3 {
                let c = lighten(*color, [0.0, 0.3, 0.55][k]);
                let pts: Vec<(i32, i32)> = p
                    .stages
                    .iter()
                    .enumerate()
                    .filter_map(|(i, st)| pick(&st.summary)[k].map(|v| (x(i), self.y(v, top))))
                    .collect();
                root.draw(&PathElement::new(pts.clone(), c.stroke_width([3, 2, 1][k])))?;
                for pt in pts {
                    match k {
                        0 => root.draw(&Circle::new(pt, 4, c.filled()))?,
                        1 => root.draw(&Rectangle::new(
                            [(pt.0 - 3, pt.1 - 3), (pt.0 + 3, pt.1 + 3)],
                            c.filled(),
                        ))?,
                        _ => root.draw(&Polygon::new(
                            vec![(pt.0, pt.1 - 4), (pt.0 - 4, pt.1 + 3), (pt.0 + 4, pt.1 + 3)],
                            c.filled(),
                        ))?,
                    }
                }
            }
        }
        Ok(())
    }

    fn bars<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        series: &[(RGBColor, &PolicyResult)],
        pick: Pick,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        let top = self.axes(root, Self::max_of(series, pick, false))?;
        let groups = series.len().max(1) as i32;
        let group_w = (self.x1 - self.x0) / groups;
        let bar_w = (group_w - 20) / 3;
        for (g, (color, p)) in series.iter().enumerate() {
            let gx = self.x0 + g as i32 * group_w + 10;
            for (k, v) in pick(&p.summary).iter().enumerate() {
                let Some(v) = v else { continue };
                let bx = gx + k as i32 * bar_w;
                let y = self.y(*v, top);
                let c = lighten(*color, [0.0, 0.35, 0.6][k]);
                root.draw(&Rectangle::new(
                    [(bx + 1, y), (bx + bar_w - 1, self.y1)],
                    c.filled(),
                ))?;
                let label = fmt_value(*v);
                let lw = text_width(&label, 1);
                draw_text(root, (bx + (bar_w - lw) / 2, y - 10), &label, 1, &BLACK)?;
            }
            let name = &p.policy;
            let w = text_width(name, 1);
            draw_text(
                root,
                (gx + (group_w - 20 - w) / 2, self.y1 + 8),
                name,
                1,
                &BLACK,
            )?;
            let key = "p50 p90 p99";
            draw_text(
                root,
                (gx + (group_w - 20 - text_width(key, 1)) / 2, self.y1 + 22),
                key,
                1,
                &GREY,
            )?;
        }
        Ok(())
    }
}
