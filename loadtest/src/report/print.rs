//! Plain-text rendering of a [`Report`]: a header naming the time base, one
//! aligned table per figure set (overall, then each model), outcomes, formulas.

use std::io::{self, Write};

use super::{FORMULAS, Figures, Report};

impl Report {
    /// Writes the human-readable report: header, figure tables, outcomes, formulas.
    pub fn print(&self, w: &mut impl Write) -> io::Result<()> {
        let c = &self.config;
        let limit = match (c.duration_s, c.requests) {
            (_, Some(n)) => format!("requests={n}"),
            (Some(d), None) => format!("duration={d}s"),
            (None, None) => String::new(),
        };
        writeln!(w, "switchyard-loadtest run against {}", c.endpoint)?;
        writeln!(
            w,
            "streams={} {limit} prompt_tokens~{} max_tokens={} timeout={}s",
            c.streams, c.prompt_tokens, c.max_tokens, c.timeout_s
        )?;
        for m in &c.models {
            writeln!(
                w,
                "model {}: weight {} -> {} workers",
                m.name, m.weight, m.workers
            )?;
        }
        for cal in &self.calibration {
            writeln!(
                w,
                "prompt {}: {} words ({:.3} tokens/word + {:.1} overhead)",
                cal.model, cal.prompt_words, cal.tokens_per_word, cal.overhead_tokens
            )?;
        }
        if self.time_scale == 1.0 {
            writeln!(w, "time: wall clock (time scale 1)")?;
        } else {
            writeln!(
                w,
                "time: ENGINE TIME - the target ran {0}x faster than real; latencies x{0}, rates /{0} \
                 (raw wall-clock values in the JSON under *_wall_clock)",
                self.time_scale
            )?;
        }
        writeln!(w)?;
        print_figures(w, "overall", &self.overall)?;
        for (model, f) in &self.per_model {
            writeln!(w)?;
            print_figures(w, &format!("model {model}"), f)?;
        }
        writeln!(w)?;
        writeln!(w, "outcomes")?;
        let width = self.outcomes.keys().map(String::len).max().unwrap_or(0);
        for (k, n) in &self.outcomes {
            writeln!(w, "  {k:<width$}  {n:>8}")?;
        }
        writeln!(w)?;
        writeln!(w, "formulas")?;
        for (k, v) in FORMULAS {
            writeln!(w, "  {k}: {v}")?;
        }
        Ok(())
    }
}

fn print_figures(w: &mut impl Write, title: &str, f: &Figures) -> io::Result<()> {
    writeln!(
        w,
        "{title:<26}{:>8}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "count", "mean", "p5", "p50", "p95", "p99", "max"
    )?;
    for (name, p) in [
        ("  TTFT (ms)", &f.ttft_ms),
        ("  ITL (ms)", &f.itl_ms),
        ("  per-stream tok/s", &f.per_stream_tokens_per_s),
    ] {
        if p.count == 0 {
            writeln!(w, "{name:<26}{:>8}{:>10}", 0, "-")?;
            continue;
        }
        writeln!(
            w,
            "{name:<26}{:>8}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
            p.count,
            num(p.mean),
            num(p.p5),
            num(p.p50),
            num(p.p95),
            num(p.p99),
            num(p.max)
        )?;
    }
    let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), num);
    let rows = [
        ("  total output tok/s", num(f.total_tokens_per_s)),
        ("  requests/s", num(f.requests_per_s)),
        ("  completed/s", num(f.completed_requests_per_s)),
        (
            "  requests ok/failed",
            format!("{}/{}", f.completed, f.failed),
        ),
        (
            "  completion tokens sum",
            f.completion_tokens_sum.to_string(),
        ),
        ("  mean prompt tokens", opt(f.prompt_tokens_mean)),
        ("  mean completion tokens", opt(f.completion_tokens_mean)),
        ("  wall time (s)", num(f.wall_time_s)),
    ];
    for (name, v) in rows {
        writeln!(w, "{name:<26}{v:>18}")?;
    }
    Ok(())
}

/// Three significant-ish digits without scientific notation.
fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}
