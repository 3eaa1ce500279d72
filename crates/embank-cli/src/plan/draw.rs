//! The plan's hit-rate curves as a PNG.

use plotters::prelude::*;

use embank_core::{human_bytes, Plan};

pub(super) fn draw(p: &Plan, path: &std::path::Path) -> Result<(), String> {
    embank_bench::plot::register_font()?;
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let max_bytes = p
        .tables
        .iter()
        .flat_map(|t| t.row_cache_curve.iter().map(|c| c.cache_bytes))
        .max()
        .unwrap_or(1 << 20)
        .max(1 << 20) as f64;
    let min_bytes =
        p.tables.iter().flat_map(|t| t.gpu_curve.iter().map(|c| c.cache_bytes)).min().unwrap_or(1 << 10).max(1024)
            as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption("predicted hit rate by cache size (embank plan)", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((min_bytes..max_bytes).log_scale(), 0f64..100f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("cache bytes")
        .y_desc("hit rate %")
        .x_label_formatter(&|b| human_bytes(*b as u64))
        .draw()
        .map_err(|e| err(&e))?;
    let colors = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44), RGBColor(214, 39, 40)];
    for (i, t) in p.tables.iter().enumerate() {
        let c = colors[i % colors.len()];
        for (curve, what, dashed) in [(&t.row_cache_curve, "row cache", false), (&t.gpu_curve, "GPU cache", true)] {
            let pts: Vec<(f64, f64)> =
                curve.iter().map(|x| (x.cache_bytes.max(1024) as f64, x.hit_rate * 100.0)).collect();
            let style = if dashed { c.mix(0.5).stroke_width(2) } else { c.stroke_width(3) };
            chart
                .draw_series(LineSeries::new(pts, style))
                .map_err(|e| err(&e))?
                .label(format!("{} ({what})", t.name))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        }
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
