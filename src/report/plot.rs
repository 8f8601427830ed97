//! PNG plots for benchmark reports: line plots (several series, optional log axes) and bar
//! charts, drawn with `plotters` on its bitmap backend. Text comes from DejaVu Sans embedded in
//! the binary (licence in `assets/fonts/`), so a fresh machine with no fonts installed draws
//! the same picture.

use plotters::coord::Shift;
use plotters::coord::ranged1d::{Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::FontStyle;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;
use std::sync::OnceLock;

static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
const WIDTH: u32 = 1000;
const HEIGHT: u32 = 620;

/// Distinct colours that stay apart for the colour-blind (Okabe-Ito, then greys).
const COLOURS: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(120, 120, 120),
    RGBColor(0, 0, 0),
];

fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

/// One named line of a [`LinePlot`].
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct LinePlot {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub log_y: bool,
    pub series: Vec<Series>,
}

/// Bars with a label each, in the order given.
#[derive(Debug, Clone, Default)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub bars: Vec<(String, f64)>,
}

#[derive(Debug, Clone)]
pub enum Plot {
    Line(LinePlot),
    Bar(BarChart),
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing finite (and positive, on a log axis) to draw.
    #[error("no data to plot")]
    Empty,
    #[error("drawing failed: {0}")]
    Draw(String),
}

fn draw_err(e: impl std::fmt::Display) -> PlotError {
    PlotError::Draw(e.to_string())
}

/// Registers the embedded font for every style plotters may ask for; once per process.
fn font_ready() -> Result<(), PlotError> {
    static READY: OnceLock<bool> = OnceLock::new();
    let ok = *READY.get_or_init(|| {
        [
            FontStyle::Normal,
            FontStyle::Bold,
            FontStyle::Italic,
            FontStyle::Oblique,
        ]
        .into_iter()
        .all(|style| plotters::style::register_font("sans-serif", style, FONT).is_ok())
    });
    if ok {
        Ok(())
    } else {
        Err(PlotError::Draw(
            "the embedded font could not be read".into(),
        ))
    }
}

impl Plot {
    pub fn title(&self) -> &str {
        match self {
            Plot::Line(p) => &p.title,
            Plot::Bar(b) => &b.title,
        }
    }

    fn has_data(&self) -> bool {
        match self {
            Plot::Line(p) => p.series.iter().any(|s| {
                s.points
                    .iter()
                    .any(|(x, y)| usable(*x, p.log_x) && usable(*y, p.log_y))
            }),
            Plot::Bar(b) => b.bars.iter().any(|(_, v)| v.is_finite() && *v > 0.0),
        }
    }

    /// Draws the plot into a PNG file at `path`.
    pub fn render(&self, path: &Path) -> Result<(), PlotError> {
        // Checked before the backend exists: dropping it writes a (blank) file.
        if !self.has_data() {
            return Err(PlotError::Empty);
        }
        font_ready()?;
        let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        match self {
            Plot::Line(p) => draw_line_plot(&root, p)?,
            Plot::Bar(b) => draw_bar_chart(&root, b)?,
        }
        root.present().map_err(draw_err)
    }
}

/// Tick labels short enough to sit under a tick: 3 significant digits, SI suffixes when large.
fn tick(v: f64) -> String {
    let a = v.abs();
    let sig3 = |x: f64| {
        let digits = (2 - x.abs().log10().floor() as i32).clamp(0, 4) as usize;
        let s = format!("{x:.digits$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if a == 0.0 {
        "0".into()
    } else if a < 1e-3 {
        format!("{v:.1e}")
    } else if a < 1e4 {
        sig3(v)
    } else if a < 1e6 {
        format!("{}k", sig3(v / 1e3))
    } else if a < 1e9 {
        format!("{}M", sig3(v / 1e6))
    } else {
        format!("{}G", sig3(v / 1e9))
    }
}

/// The range covering `values`, padded so the extreme points are not drawn on the frame.
fn span(values: impl Iterator<Item = f64>, log: bool) -> Option<(f64, f64)> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return None;
    }
    Some(if log {
        let pad = if hi > lo { 1.25 } else { 2.0 };
        (lo / pad, hi * pad)
    } else {
        let pad = if hi > lo {
            0.06 * (hi - lo)
        } else {
            lo.abs().max(1.0) * 0.5
        };
        (lo - pad, hi + pad)
    })
}

fn usable(v: f64, log: bool) -> bool {
    v.is_finite() && (!log || v > 0.0)
}

fn draw_line_plot(root: &DrawingArea<BitMapBackend, Shift>, p: &LinePlot) -> Result<(), PlotError> {
    let points = || {
        p.series.iter().flat_map(|s| {
            s.points
                .iter()
                .filter(|(x, y)| usable(*x, p.log_x) && usable(*y, p.log_y))
        })
    };
    let xs = span(points().map(|pt| pt.0), p.log_x).ok_or(PlotError::Empty)?;
    let ys = span(points().map(|pt| pt.1), p.log_y).ok_or(PlotError::Empty)?;
    let lin = |(a, b): (f64, f64)| RangedCoordf64::from(a..b);
    let log = |(a, b): (f64, f64)| LogCoord::from((a..b).log_scale());
    match (p.log_x, p.log_y) {
        (false, false) => draw_lines(root, p, lin(xs), lin(ys)),
        (true, false) => draw_lines(root, p, log(xs), lin(ys)),
        (false, true) => draw_lines(root, p, lin(xs), log(ys)),
        (true, true) => draw_lines(root, p, log(xs), log(ys)),
    }
}

fn draw_lines<X, Y>(
    root: &DrawingArea<BitMapBackend, Shift>,
    p: &LinePlot,
    x: X,
    y: Y,
) -> Result<(), PlotError>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(root)
        .caption(&p.title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc(p.x_label.as_str())
        .y_desc(p.y_label.as_str())
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(draw_err)?;
    for (i, s) in p.series.iter().enumerate() {
        let c = colour(i);
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|(x, y)| usable(*x, p.log_x) && usable(*y, p.log_y))
            .collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(draw_err)?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
        // Markers show where the measurements are when a series has few points.
        if pts.len() <= 40 {
            chart
                .draw_series(pts.iter().map(|&pt| Circle::new(pt, 3, c.filled())))
                .map_err(draw_err)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(draw_err)
}

fn draw_bar_chart(root: &DrawingArea<BitMapBackend, Shift>, b: &BarChart) -> Result<(), PlotError> {
    let bars: Vec<(&str, f64)> = b
        .bars
        .iter()
        .filter(|(_, v)| v.is_finite() && *v >= 0.0)
        .map(|(l, v)| (l.as_str(), *v))
        .collect();
    let top = bars.iter().map(|b| b.1).fold(0.0f64, f64::max);
    if bars.is_empty() || top <= 0.0 {
        return Err(PlotError::Empty);
    }
    let n = bars.len();
    let mut chart = ChartBuilder::on(root)
        .caption(&b.title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80)
        // Bar i is centred on x = i; the labels sit on the integer ticks.
        .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..top * 1.12)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc(b.y_label.as_str())
        .x_labels(2 * n + 1)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                bars.get(i as usize)
                    .map_or(String::new(), |b| b.0.to_string())
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| tick(*v))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(draw_err)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            let x = i as f64;
            Rectangle::new([(x - 0.38, 0.0), (x + 0.38, *v)], colour(i).filled())
        }))
        .map_err(draw_err)?;
    // The value above each bar, so the chart reads without the table.
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            Text::new(
                tick(*v),
                (i as f64, v + top * 0.01),
                ("sans-serif", 15)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            )
        }))
        .map_err(draw_err)?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A PNG file: the 8-byte signature, then an IHDR chunk with the size drawn.
    pub(crate) fn assert_png(path: &Path) {
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(
            &bytes[..8],
            b"\x89PNG\r\n\x1a\n",
            "{} is not a PNG",
            path.display()
        );
        assert_eq!(&bytes[12..16], b"IHDR");
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((w, h), (WIDTH, HEIGHT));
        // A blank white image compresses to a few hundred bytes; text and lines do not.
        assert!(
            bytes.len() > 8_000,
            "{} is only {} bytes",
            path.display(),
            bytes.len()
        );
    }

    #[test]
    fn a_log_log_line_plot_is_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lines.png");
        let ns = [128.0, 512.0, 2048.0, 8192.0];
        let plot = Plot::Line(LinePlot {
            title: "time against N".into(),
            x_label: "N".into(),
            y_label: "ms".into(),
            log_x: true,
            log_y: true,
            series: vec![
                Series::new("linear", ns.iter().map(|&n| (n, n * 1e-3)).collect()),
                Series::new("quadratic", ns.iter().map(|&n| (n, n * n * 1e-6)).collect()),
                // Non-positive values cannot sit on a log axis and are left out, not fatal.
                Series::new("with a zero", vec![(128.0, 0.0), (512.0, 1.0)]),
            ],
        });
        plot.render(&path).unwrap();
        assert_png(&path);
    }

    #[test]
    fn a_bar_chart_is_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bars.png");
        let plot = Plot::Bar(BarChart {
            title: "tokens/s".into(),
            y_label: "tokens/s".into(),
            bars: vec![("fp32".into(), 51_700.0), ("bf16-mixed".into(), 310_000.0)],
        });
        plot.render(&path).unwrap();
        assert_png(&path);
    }

    #[test]
    fn nothing_to_draw_is_an_error_not_an_empty_picture() {
        let dir = tempfile::tempdir().unwrap();
        let line = Plot::Line(LinePlot {
            log_y: true,
            series: vec![Series::new("zeros", vec![(1.0, 0.0), (2.0, -1.0)])],
            ..LinePlot::default()
        });
        assert!(matches!(
            line.render(&dir.path().join("a.png")),
            Err(PlotError::Empty)
        ));
        let bars = Plot::Bar(BarChart::default());
        assert!(matches!(
            bars.render(&dir.path().join("b.png")),
            Err(PlotError::Empty)
        ));
    }

    #[test]
    fn ticks_are_short() {
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(2048.0), "2048");
        assert_eq!(tick(0.125), "0.125");
        assert_eq!(tick(1.5), "1.5");
        assert_eq!(tick(310_000.0), "310k");
        assert_eq!(tick(51_700.0), "51.7k");
        assert_eq!(tick(2.5e9), "2.5G");
        assert_eq!(tick(2e-5), "2.0e-5");
    }
}
