//! A sweep plot: one figure against offered load, one line per series with
//! its min-max range shaded (medians over seeds, with the seeds' spread).
//! The y axis is logarithmic when the values span more than two decades, as
//! latencies past saturation do. Drawn with plotters' bitmap backend; text
//! from [`super::font`].

use std::path::Path;

use plotters::prelude::*;

use super::font::{draw_text, text_width};
use super::plot::{fmt_value, policy_color, tick_step};
use crate::error::LoadgenError;

const W: i32 = 960;
const H: i32 = 600;
const LEFT: i32 = 80;
const RIGHT: i32 = 30;
const TOP: i32 = 90;
const BOTTOM: i32 = 60;

/// One line: `(x, median, low, high)` per point.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64, f64, f64)>,
}

/// Draws `series` into a PNG at `path`.
pub fn write_png(
    title: &str,
    x_label: &str,
    series: &[Series],
    path: &Path,
) -> Result<(), LoadgenError> {
    let err = |e: String| LoadgenError::Plot {
        path: path.to_path_buf(),
        reason: e,
    };
    let root = BitMapBackend::new(path, (W as u32, H as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    draw(&root, title, x_label, series).map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Maps values to pixels, linear or logarithmic.
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
    px0: i32,
    px1: i32,
}

impl Axis {
    fn px(&self, v: f64) -> i32 {
        let f = |v: f64| if self.log { v.max(self.lo).log10() } else { v };
        let (a, b) = (f(self.lo), f(self.hi));
        let t = if b > a { (f(v) - a) / (b - a) } else { 0.0 };
        self.px0 + (t * f64::from(self.px1 - self.px0)).round() as i32
    }

    /// Tick values: powers of ten (log) or about five round steps (linear).
    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut v = 10f64.powf(self.lo.log10().floor());
            let mut out = Vec::new();
            while v <= self.hi * 1.0001 && out.len() < 12 {
                if v >= self.lo {
                    out.push(v);
                }
                v *= 10.0;
            }
            return out;
        }
        let step = tick_step(self.hi - self.lo);
        let mut v = (self.lo / step).ceil() * step;
        let mut out = Vec::new();
        while v <= self.hi + step / 2.0 && out.len() < 12 {
            out.push(v);
            v += step;
        }
        out
    }
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    series: &[Series],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    // Large type when the title fits the width, small otherwise.
    let big = text_width(title, 2) <= W - LEFT - RIGHT;
    draw_text(root, (LEFT, 12), title, if big { 2 } else { 1 }, &BLACK)?;
    let mut x = LEFT;
    for (i, s) in series.iter().enumerate() {
        let (r, g, b) = policy_color(i);
        root.draw(&Rectangle::new(
            [(x, 44), (x + 16, 58)],
            RGBColor(r, g, b).filled(),
        ))?;
        draw_text(root, (x + 22, 46), &s.name, 1, &BLACK)?;
        x += 22 + text_width(&s.name, 1) + 22;
    }
    draw_text(
        root,
        (LEFT, 66),
        "line: median over seeds; band: min-max",
        1,
        &BLACK,
    )?;
    let all = || series.iter().flat_map(|s| s.points.iter());
    let xs: Vec<f64> = all().map(|p| p.0).collect();
    let ys: Vec<f64> = all()
        .flat_map(|p| [p.2, p.3])
        .filter(|v| *v > 0.0)
        .collect();
    let (Some(x_hi), Some(y_lo), Some(y_hi)) = (
        xs.iter().copied().reduce(f64::max),
        ys.iter().copied().reduce(f64::min),
        ys.iter().copied().reduce(f64::max),
    ) else {
        draw_text(root, (LEFT + 20, H / 2), "no data", 2, &BLACK)?;
        return Ok(());
    };
    let log = y_hi / y_lo > 100.0;
    let xa = Axis {
        lo: 0.0,
        hi: x_hi * 1.05,
        log: false,
        px0: LEFT,
        px1: W - RIGHT,
    };
    let ya = Axis {
        lo: if log { y_lo * 0.8 } else { 0.0 },
        hi: y_hi * 1.1,
        log,
        px0: H - BOTTOM,
        px1: TOP,
    };
    let grey = RGBColor(210, 210, 210);
    for v in ya.ticks() {
        let y = ya.px(v);
        root.draw(&PathElement::new(vec![(LEFT, y), (W - RIGHT, y)], grey))?;
        let t = fmt_value(v);
        draw_text(root, (LEFT - 6 - text_width(&t, 1), y - 4), &t, 1, &BLACK)?;
    }
    for v in xa.ticks() {
        let x = xa.px(v);
        let t = fmt_value(v);
        draw_text(
            root,
            (x - text_width(&t, 1) / 2, H - BOTTOM + 8),
            &t,
            1,
            &BLACK,
        )?;
    }
    draw_text(
        root,
        ((W - text_width(x_label, 1)) / 2, H - BOTTOM + 30),
        x_label,
        1,
        &BLACK,
    )?;
    root.draw(&Rectangle::new(
        [(LEFT, TOP), (W - RIGHT, H - BOTTOM)],
        BLACK,
    ))?;
    for (i, s) in series.iter().enumerate() {
        let (r, g, b) = policy_color(i);
        let c = RGBColor(r, g, b);
        let mut band: Vec<(i32, i32)> = s.points.iter().map(|p| (xa.px(p.0), ya.px(p.3))).collect();
        band.extend(s.points.iter().rev().map(|p| (xa.px(p.0), ya.px(p.2))));
        if band.len() >= 3 {
            root.draw(&Polygon::new(band, c.mix(0.15).filled()))?;
        }
        let line: Vec<(i32, i32)> = s.points.iter().map(|p| (xa.px(p.0), ya.px(p.1))).collect();
        root.draw(&PathElement::new(line.clone(), c.stroke_width(2)))?;
        for pt in line {
            root.draw(&Circle::new(pt, 3, c.filled()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png_with_log_axis_and_without_data() {
        let dir = tempfile::tempdir().unwrap();
        let s = vec![
            Series {
                name: "a".into(),
                points: vec![(1.0, 10.0, 8.0, 12.0), (2.0, 5000.0, 3000.0, 9000.0)],
            },
            Series {
                name: "b".into(),
                points: vec![(1.0, 20.0, 20.0, 20.0)],
            },
        ];
        let p = dir.path().join("x.png");
        write_png("t", "rate", &s, &p).unwrap();
        assert!(std::fs::metadata(&p).unwrap().len() > 1000);
        let empty = dir.path().join("e.png");
        write_png("t", "rate", &[], &empty).unwrap();
        assert!(empty.exists());
    }

    #[test]
    fn axes_map_ends_and_tick_sensibly() {
        let lin = Axis {
            lo: 0.0,
            hi: 100.0,
            log: false,
            px0: 0,
            px1: 100,
        };
        assert_eq!(lin.px(50.0), 50);
        assert_eq!(lin.ticks(), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        let log = Axis {
            lo: 1.0,
            hi: 1000.0,
            log: true,
            px0: 0,
            px1: 300,
        };
        assert_eq!(log.px(10.0), 100);
        assert_eq!(log.ticks(), vec![1.0, 10.0, 100.0, 1000.0]);
    }
}
