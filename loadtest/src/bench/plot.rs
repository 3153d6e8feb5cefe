//! `bench.png`: added TTFT (p50 and p99) and the throughput ratio against streams, Switchyard
//! beside LiteLLM, and a table of the other scenarios' figures. Drawn by plotters' bitmap
//! backend with a pure-Rust rasterizer (ab_glyph); the font is the system's (DejaVu Sans on
//! Debian, `fonts-dejavu-core`), or the file `SWITCHYARD_BENCH_FONT` names: nothing bundled.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::anyhow;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use super::{BenchReport, Figure};

/// A TrueType font to draw text with, instead of the system's.
pub const FONT_ENV: &str = "SWITCHYARD_BENCH_FONT";

/// Where Debian, Arch and Fedora put DejaVu Sans or Liberation Sans.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Added latency at or below this is drawn at it (the axis is logarithmic).
const FLOOR_MS: f64 = 0.1;

pub(crate) const FONT: &str = "sans-serif";
const SWITCHYARD: RGBColor = RGBColor(31, 119, 180);
const LITELLM: RGBColor = RGBColor(214, 39, 40);
const GREY: RGBColor = RGBColor(120, 120, 120);

/// Draws the report into a PNG at `path`.
pub fn draw(report: &BenchReport, path: &Path) -> anyhow::Result<()> {
    font()?;
    let root = BitMapBackend::new(path, (1500, 1150)).into_drawing_area();
    root.fill(&WHITE)?;
    let m = &report.machine;
    let title = format!(
        "switchyard-loadtest bench{} — {} — commit {} — {} cores, load {} → {} — each figure against the engine directly, same run",
        if report.quick { " --quick" } else { "" },
        m.date,
        m.git_commit
            .as_deref()
            .map_or("?", |c| &c[..c.len().min(10)]),
        m.cores,
        first(&m.load_average[0]),
        first(&m.load_average[1]),
    );
    let root = root.titled(&title, (FONT, 20))?;
    let (top, bottom) = root.split_vertically(520);
    let (left, right) = top.split_horizontally(750);
    added_ttft(&left, report)?;
    throughput(&right, report)?;
    table(&bottom, report)?;
    root.present()?;
    Ok(())
}

/// The (streams, value) points of `name` through `subject` in the overhead scenario.
pub(super) fn series(
    report: &BenchReport,
    subject: &str,
    name: &str,
    value: impl Fn(&Figure) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let mut points: Vec<(f64, f64)> = report
        .figures
        .iter()
        .filter(|f| f.scenario == "overhead" && f.subject == subject && f.name == name)
        .filter_map(|f| Some((f.streams as f64, value(f)?)))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    points
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn added_ttft(area: &Area<'_>, report: &BenchReport) -> anyhow::Result<()> {
    let lines = [
        (
            "Switchyard p50",
            "switchyard",
            "ttft_p50_ms",
            SWITCHYARD,
            false,
        ),
        (
            "Switchyard p99",
            "switchyard",
            "ttft_p99_ms",
            SWITCHYARD,
            true,
        ),
        ("LiteLLM p50", "litellm", "ttft_p50_ms", LITELLM, false),
        ("LiteLLM p99", "litellm", "ttft_p99_ms", LITELLM, true),
    ]
    .map(|(label, subject, name, color, dashed)| {
        let points = series(report, subject, name, |f| Some(f.added.max(FLOOR_MS)));
        (label, points, color, dashed)
    });
    let top = lines
        .iter()
        .flat_map(|l| l.1.iter().map(|p| p.1))
        .fold(10.0f64, f64::max)
        * 3.0;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Added TTFT over the direct engine (ms, log; ≤ 0.1 drawn at 0.1)",
            (FONT, 18),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((0.8f64..300f64).log_scale(), (FLOOR_MS..top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("concurrent streams")
        .y_desc("added TTFT (ms)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y}"))
        .label_style((FONT, 14))
        .draw()?;
    for (label, points, color, dashed) in lines {
        if points.is_empty() {
            continue;
        }
        let style = color.stroke_width(2);
        if dashed {
            chart
                .draw_series(DashedLineSeries::new(points.clone(), 8, 5, style))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 8, y)], color.stroke_width(2))
                });
        } else {
            chart
                .draw_series(LineSeries::new(points.clone(), style))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    legend(&mut chart)
}

fn throughput(area: &Area<'_>, report: &BenchReport) -> anyhow::Result<()> {
    let lines = [
        ("Switchyard", "switchyard", SWITCHYARD),
        ("LiteLLM", "litellm", LITELLM),
    ]
    .map(|(label, subject, color)| {
        (
            label,
            series(report, subject, "tokens_per_s", |f| f.ratio),
            color,
        )
    });
    let top = lines
        .iter()
        .flat_map(|l| l.1.iter().map(|p| p.1))
        .fold(1.1f64, f64::max)
        + 0.05;
    let mut chart = ChartBuilder::on(area)
        .caption("Throughput / direct engine's (tokens/s)", (FONT, 18))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((0.8f64..300f64).log_scale(), 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("concurrent streams")
        .y_desc("ratio")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .label_style((FONT, 14))
        .draw()?;
    chart
        .draw_series(DashedLineSeries::new(
            [(0.8, 1.0), (300.0, 1.0)],
            6,
            6,
            GREY.stroke_width(1),
        ))?
        .label("direct = 1")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREY.stroke_width(1)));
    for (label, points, color) in lines {
        if points.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    legend(&mut chart)
}

fn legend<'a, X, Y>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()?;
    Ok(())
}

/// The rows of the table: every figure outside the overhead scenario's latency lines (a
/// `failed` row only when something failed), and the overhead's CPU and memory.
pub(super) fn table_rows(report: &BenchReport) -> Vec<[String; 7]> {
    report
        .figures
        .iter()
        .filter(|f| match (f.scenario.as_str(), f.name.as_str()) {
            (_, "failed") => f.value > 0.0 || f.direct > 0.0,
            ("overhead", name) => name == "cpu_us_per_token" || name == "peak_rss_mib",
            _ => true,
        })
        .map(|f| {
            [
                f.scenario.clone(),
                f.subject.clone(),
                f.streams.to_string(),
                f.name.clone(),
                num(f.value),
                num(f.direct),
                f.ratio
                    .map_or_else(|| "-".to_owned(), |r| format!("{r:.3}")),
            ]
        })
        .collect()
}

fn table(area: &Area<'_>, report: &BenchReport) -> anyhow::Result<()> {
    const HEAD: [&str; 7] = [
        "scenario", "subject", "streams", "figure", "value", "direct", "ratio",
    ];
    // Left edge of each column within a half of the width.
    const X: [i32; 7] = [20, 105, 285, 345, 530, 620, 700];
    const ROW: i32 = 19;
    let (width, height) = area.dim_in_pixel();
    let per_column = ((height as i32 - 40) / ROW - 1).max(1) as usize;
    let rows = table_rows(report);
    let style = (FONT, 14).into_font().color(&BLACK);
    let bold = (FONT, 14).into_font().color(&GREY);
    for (half, chunk) in rows.chunks(per_column).take(2).enumerate() {
        let dx = half as i32 * (width as i32 / 2);
        for (c, h) in HEAD.iter().enumerate() {
            area.draw(&Text::new(*h, (dx + X[c], 10), bold.clone()))?;
        }
        for (r, row) in chunk.iter().enumerate() {
            let y = 10 + ROW * (r as i32 + 1);
            for (c, cell) in row.iter().enumerate() {
                area.draw(&Text::new(cell.clone(), (dx + X[c], y), style.clone()))?;
            }
        }
    }
    if rows.len() > 2 * per_column {
        let more = format!("… {} more rows in bench.json", rows.len() - 2 * per_column);
        area.draw(&Text::new(more, (20, height as i32 - 22), style))?;
    }
    Ok(())
}

/// The one-minute figure of a /proc/loadavg reading.
fn first(load: &Option<String>) -> &str {
    load.as_deref()
        .and_then(|l| l.split(' ').next())
        .unwrap_or("?")
}

/// Four significant figures or so.
fn num(v: f64) -> String {
    match v.abs() {
        a if a >= 1000.0 => format!("{v:.0}"),
        a if a >= 100.0 => format!("{v:.1}"),
        a if a >= 1.0 => format!("{v:.2}"),
        _ => format!("{v:.3}"),
    }
}

/// Registers the font once per process.
pub(crate) fn font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let registered = REGISTERED.get_or_init(|| {
        let path = find_font().ok_or_else(|| {
            format!(
                "no TrueType font found: set {FONT_ENV} to a .ttf file or install one \
                 (Debian: apt-get install fonts-dejavu-core)"
            )
        })?;
        let bytes = std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        // plotters keeps fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        register_font(FONT, FontStyle::Normal, bytes)
            .map_err(|_| format!("{} is not a font ab_glyph reads", path.display()))?;
        Ok(path)
    });
    registered.as_ref().map(|_| ()).map_err(|e| anyhow!("{e}"))
}

/// `SWITCHYARD_BENCH_FONT`, a known sans-serif, else any `.ttf` under /usr/share/fonts.
fn find_font() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(FONT_ENV) {
        return Some(PathBuf::from(path));
    }
    if let Some(known) = FONTS.iter().map(PathBuf::from).find(|p| p.is_file()) {
        return Some(known);
    }
    let mut found = Vec::new();
    let mut dirs = vec![PathBuf::from("/usr/share/fonts")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("ttf"))
            {
                found.push(path);
            }
        }
    }
    found.sort();
    // Prefer a plain sans-serif face.
    let plain = |p: &PathBuf| {
        let name = p.file_name().map(|n| n.to_string_lossy().to_lowercase());
        name.is_some_and(|n| {
            n.contains("sans")
                && !["bold", "oblique", "italic", "mono"]
                    .iter()
                    .any(|s| n.contains(s))
        })
    };
    found.iter().find(|p| plain(p)).or(found.first()).cloned()
}
