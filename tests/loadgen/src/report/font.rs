//! Text for plots without system fonts: glyphs of the public-domain 8×8
//! bitmap font (`font8x8`) drawn as filled squares. plotters' own text path
//! needs a font engine (and panics without one), so the plot never calls it.

use font8x8::UnicodeFonts;
use plotters::coord::Shift;
use plotters::prelude::*;

/// Width in pixels of `text` at `scale`.
pub fn text_width(text: &str, scale: i32) -> i32 {
    text.chars().count() as i32 * 8 * scale
}

/// Draws `text` with its top-left corner at `(x, y)`, each font pixel a
/// `scale`×`scale` square. Characters outside Basic Latin draw as `?`.
pub fn draw_text<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    (x, y): (i32, i32),
    text: &str,
    scale: i32,
    color: &RGBColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    for (i, ch) in text.chars().enumerate() {
        let glyph = font8x8::BASIC_FONTS
            .get(ch)
            .or_else(|| font8x8::BASIC_FONTS.get('?'))
            .unwrap_or([0; 8]);
        let gx = x + i as i32 * 8 * scale;
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8 {
                if bits & (1 << col) != 0 {
                    let px = gx + col * scale;
                    let py = y + row as i32 * scale;
                    for dy in 0..scale {
                        for dx in 0..scale {
                            area.draw_pixel((px + dx, py + dy), color)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
