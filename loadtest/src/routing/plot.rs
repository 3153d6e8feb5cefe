//! `routing.png`: for the mix, TTFT p95 and the prefix-cache hit rate of each model against
//! load, one colour per strategy; for llm-d's shape, mean TTFT and output throughput per
//! strategy. Same drawing setup as `bench.png` (the system's font, nothing bundled).

use std::path::Path;

use plotters::prelude::*;

use super::{RoutingReport, Row, Strategy};
use crate::bench::plot::{FONT, font};

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn color(s: Strategy) -> RGBColor {
    match s {
        Strategy::RoundRobin => RGBColor(214, 39, 40),
        Strategy::LeastLoaded => RGBColor(255, 127, 14),
        Strategy::CacheAware => RGBColor(31, 119, 180),
        Strategy::Oracle => RGBColor(120, 120, 120),
    }
}

/// Draws the report into a PNG at `path`.
pub fn draw(report: &RoutingReport, path: &Path) -> anyhow::Result<()> {
    font()?;
    let root = BitMapBackend::new(path, (1500, 1000)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "switchyard-loadtest routing — {} — seed {} — {:.0} s measured after {:.0} s, virtual time",
        report.date, report.seed, report.window_s, report.warmup_s
    );
    let root = root.titled(&title, (FONT, 20))?;
    let (top, bottom) = root.split_vertically(500);
    let models: Vec<&str> = ["8b", "32b", "70b"]
        .into_iter()
        .filter(|m| {
            report
                .rows
                .iter()
                .any(|r| r.scenario == "mix" && r.model == *m)
        })
        .collect();
    let cols = models.len().max(1);
    let top_areas = top.split_evenly((1, cols));
    for (area, model) in top_areas.iter().zip(&models) {
        mix_panel(
            area,
            report,
            model,
            "TTFT p95 (s, log)",
            |r| r.ttft_p95,
            true,
        )?;
    }
    let (left, right) = bottom.split_horizontally(750);
    mix_panel(
        &left,
        report,
        "8b",
        "8B prefix-cache hit rate (%)",
        |r| r.hit_rate * 100.0,
        false,
    )?;
    llmd_panel(&right, report)?;
    root.present()?;
    Ok(())
}

fn mix_panel(
    area: &Area<'_>,
    report: &RoutingReport,
    model: &str,
    what: &str,
    value: impl Fn(&Row) -> f64,
    log: bool,
) -> anyhow::Result<()> {
    let rows: Vec<&Row> = report
        .rows
        .iter()
        .filter(|r| r.scenario == "mix" && r.model == model)
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    let top = rows.iter().map(|r| value(r)).fold(0.1f64, f64::max) * 1.5;
    let caption = format!("{model}: {what} against load (% of capacity)");
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(caption, (FONT, 17))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60);
    let x = 40f64..120f64;
    if log {
        let mut chart = builder.build_cartesian_2d(x, (0.01f64..top).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("load %")
            .label_style((FONT, 13))
            .draw()?;
        lines(&mut chart, &rows, &value, 0.01)?;
        legend(&mut chart)?;
    } else {
        let mut chart = builder.build_cartesian_2d(x, 0f64..100f64)?;
        chart
            .configure_mesh()
            .x_desc("load %")
            .label_style((FONT, 13))
            .draw()?;
        lines(&mut chart, &rows, &value, 0.0)?;
        legend(&mut chart)?;
    }
    Ok(())
}

fn lines<'a, CT>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, CT>,
    rows: &[&Row],
    value: &impl Fn(&Row) -> f64,
    floor: f64,
) -> anyhow::Result<()>
where
    CT: plotters::coord::CoordTranslate<From = (f64, f64)>,
{
    // The oracle first: where cache_aware matches it, cache_aware's colour shows.
    let order = [
        Strategy::RoundRobin,
        Strategy::LeastLoaded,
        Strategy::Oracle,
        Strategy::CacheAware,
    ];
    for s in order {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.strategy == s)
            .map(|r| (r.load * 100.0, value(r).max(floor)))
            .collect();
        if points.is_empty() {
            continue;
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let c = color(s);
        chart
            .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(s.name())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], c.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 4, c.filled())))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(())
}

fn legend<'a, CT>(chart: &mut ChartContext<'a, BitMapBackend<'a>, CT>) -> anyhow::Result<()>
where
    CT: plotters::coord::CoordTranslate<From = (f64, f64)>,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// llm-d's shape: mean TTFT (bars, left) and output tokens/s (numbers) per strategy.
fn llmd_panel(area: &Area<'_>, report: &RoutingReport) -> anyhow::Result<()> {
    let rows: Vec<&Row> = report
        .rows
        .iter()
        .filter(|r| r.scenario.starts_with("llm-d"))
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    let top = rows.iter().map(|r| r.ttft_mean).fold(0.1f64, f64::max) * 1.3;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "llm-d's shape (8 × 8B, 512 clients; 900 / 200 tokens out): mean TTFT s, output tok/s",
            (FONT, 17),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..rows.len() as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .label_style((FONT, 13))
        .draw()?;
    for (i, r) in rows.iter().enumerate() {
        let x = i as f64;
        let c = color(r.strategy);
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.15, 0.0), (x + 0.85, r.ttft_mean)],
            c.filled(),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            format!("{:.1} s", r.ttft_mean),
            (x + 0.15, r.ttft_mean + top * 0.07),
            (FONT, 13),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            format!("{:.0} tok/s", r.output_tokens_per_s),
            (x + 0.05, r.ttft_mean + top * 0.03),
            (FONT, 12),
        )))?;
        let name = match r.strategy {
            Strategy::RoundRobin => "rr",
            Strategy::LeastLoaded => "ll",
            Strategy::CacheAware => "cache",
            Strategy::Oracle => "oracle",
        };
        let short = if r.scenario == "llm-d" { "900" } else { "200" };
        chart.draw_series(std::iter::once(Text::new(
            format!("{name} {short}"),
            (x + 0.1, top * 0.97),
            (FONT, 12),
        )))?;
    }
    Ok(())
}
