//! A PNG beside the JSON: throughput per engine and the batch-latency CDF.

use std::path::Path;

use plotters::prelude::*;

use super::Report;

/// Where the text font comes from (Debian's fonts-dejavu-core).
const FONT_PATHS: [&str; 2] =
    ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/TTF/DejaVuSans.ttf"];

pub fn register_font() -> Result<(), String> {
    use std::sync::OnceLock;
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = FONT_PATHS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or_else(|| format!("no font found (install fonts-dejavu-core; looked in {FONT_PATHS:?})"))?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
            .map_err(|_| "the DejaVu font could not be read".to_string())
    })
    .clone()
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws the report into `path` (PNG).
pub fn draw(report: &Report, path: &Path) -> Result<(), String> {
    register_font()?;
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let measured: Vec<_> = report.engines.iter().filter(|e| e.skipped.is_none()).collect();
    if measured.is_empty() {
        return Err("no engine was measured".into());
    }
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "{}: {} keys x dim {}, batch {}, Zipf {}, {} threads",
        report.workload.name(),
        report.keys,
        report.dim,
        report.batch,
        report.zipf,
        report.threads
    );
    let root = root.titled(&title, ("sans-serif", 22)).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(620);

    // Throughput bars, with the gather limit as a line.
    let top = measured.iter().map(|e| e.keys_per_second).fold(report.gather_keys_per_second, f64::max) / 1e6 * 1.15;
    let n = measured.len();
    let mut chart = ChartBuilder::on(&left)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .caption("throughput, M keys/s (bar colours as in the latency legend)", ("sans-serif", 16))
        .build_cartesian_2d(0f64..n as f64, 0f64..top)
        .map_err(|e| err(&e))?;
    // The engines' names under their bars: labels every half unit, named at the centres.
    let names: Vec<String> = measured.iter().map(|e| e.engine.clone()).collect();
    let name_at = |x: &f64| {
        let i = x.floor();
        if (x - i - 0.5).abs() < 1e-6 && (i as usize) < names.len() {
            names[i as usize].clone()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(2 * n + 1)
        .x_label_formatter(&name_at)
        .x_label_style(("sans-serif", 13))
        .y_desc("M keys/s")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, e) in measured.iter().enumerate() {
        let v = e.keys_per_second / 1e6;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, v)],
                COLORS[i % 6].filled(),
            )))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{v:.2}"),
                (i as f64 + 0.3, v + top * 0.02),
                ("sans-serif", 15),
            )))
            .map_err(|e| err(&e))?;
    }
    let g = report.gather_keys_per_second / 1e6;
    if g.is_finite() && g > 0.0 {
        // Not measured with --skip-limits.
        chart
            .draw_series(LineSeries::new(vec![(0.0, g), (n as f64, g)], BLACK.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!("index-free gather {g:.1}"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
    }

    // Latency CDF on a log axis.
    let lo = measured.iter().filter_map(|e| e.latency_cdf.first().map(|p| p.0)).fold(f64::MAX, f64::min).max(1.0) * 0.8;
    let hi = measured.iter().filter_map(|e| e.latency_cdf.last().map(|p| p.0)).fold(0.0, f64::max).max(lo * 2.0) * 1.2;
    let mut chart = ChartBuilder::on(&right)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .caption("batch latency CDF", ("sans-serif", 18))
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("microseconds per batch (log)")
        .y_desc("fraction of batches")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, e) in measured.iter().enumerate() {
        let color = COLORS[i % 6];
        chart
            .draw_series(LineSeries::new(e.latency_cdf.iter().copied(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(e.engine.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
