//! The simulated GPUs as NVIDIA's DCGM exporter shows them, on the engine's own `/metrics`.
//!
//! A real node has a DCGM exporter beside vLLM (deploy/nvidia/dcgm-exporter.yaml); the
//! simulator has no GPU, so it exports the exporter's gauges for the GPUs its profile stands
//! for, derived from what the engine really did: the share of the last [`WINDOW`] during which
//! the scheduler was running a step (prefill or decode) is the graphics engine's activity, as
//! DCGM averages `DCGM_FI_PROF_GR_ENGINE_ACTIVE` over its sampling interval. With tensor
//! parallelism every GPU of the replica runs every step, so all show the same activity. Memory
//! is what vLLM reserves at start (`--gpu-memory-utilization` of each GPU), as on a real node.
//!
//! Names, units and labels are dcgm-exporter's (`gpu`, `UUID`, `device`, `modelName`,
//! `Hostname`); the exporter adds `namespace`, `pod` and `container` in Kubernetes, which the
//! scrape adds here.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// The span activity is averaged over (wall time).
pub const WINDOW: Duration = Duration::from_secs(1);

/// Busy intervals of the engine over the last [`WINDOW`], merged when they touch.
#[derive(Debug, Clone, Default)]
pub struct BusyMeter {
    intervals: VecDeque<(Instant, Instant)>,
}

impl BusyMeter {
    /// Records that a step ran from `start` to `end`.
    pub fn record(&mut self, start: Instant, end: Instant) {
        if end <= start {
            return;
        }
        match self.intervals.back_mut() {
            // Steps run back to back: one interval while the engine stays busy.
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => self.intervals.push_back((start, end)),
        }
        while self
            .intervals
            .front()
            .is_some_and(|(_, e)| end.saturating_duration_since(*e) > WINDOW)
        {
            self.intervals.pop_front();
        }
    }

    /// The busy share (0–1) of the [`WINDOW`] that ends at `now`.
    pub fn fraction(&self, now: Instant) -> f64 {
        let from = now.checked_sub(WINDOW).unwrap_or(now);
        let busy: Duration = self
            .intervals
            .iter()
            .map(|(s, e)| {
                let (s, e) = ((*s).max(from), (*e).min(now));
                e.saturating_duration_since(s)
            })
            .sum();
        (busy.as_secs_f64() / WINDOW.as_secs_f64()).clamp(0.0, 1.0)
    }
}

/// The GPUs one simulated replica stands for.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    /// GPUs of the replica (the profile's tensor-parallel size).
    pub gpus: u64,
    /// Memory of one GPU, MiB.
    pub memory_mib: f64,
    /// `--gpu-memory-utilization`: the share vLLM takes at start.
    pub utilization: f64,
    /// Identifies this engine's GPUs in their UUIDs (the engine's start time).
    pub serial: u64,
    /// The machine's name, as the exporter's `Hostname` label.
    pub hostname: String,
}

impl GpuInfo {
    /// The host's name from the kernel, or `localhost`.
    pub fn hostname() -> String {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "localhost".into())
    }
}

/// The DCGM exporter's gauges for every GPU of the replica, at `now`.
pub fn render(busy: &BusyMeter, info: &GpuInfo, now: Instant) -> String {
    let active = busy.fraction(now);
    let used = (info.memory_mib * info.utilization).round();
    let free = (info.memory_mib - used).max(0.0);
    let families: [(&str, &str, f64); 4] = [
        (
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
            "Ratio of time the graphics engine is active.",
            active,
        ),
        (
            "DCGM_FI_DEV_GPU_UTIL",
            "GPU utilization (in %).",
            (active * 100.0).round(),
        ),
        (
            "DCGM_FI_DEV_FB_USED",
            "Framebuffer memory used (in MiB).",
            used,
        ),
        (
            "DCGM_FI_DEV_FB_FREE",
            "Framebuffer memory free (in MiB).",
            free,
        ),
    ];
    let mut out = String::new();
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for gpu in 0..info.gpus {
            let _ = writeln!(
                out,
                "{name}{{gpu=\"{gpu}\",UUID=\"GPU-{serial:08x}-0000-4000-8000-{gpu:012x}\",device=\"nvidia{gpu}\",modelName=\"NVIDIA L40S (simulated)\",Hostname=\"{host}\"}} {value}",
                serial = info.serial & 0xffff_ffff,
                host = info.hostname,
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn idle_engine_is_inactive() {
        let t = Instant::now() + WINDOW;
        assert_eq!(BusyMeter::default().fraction(t), 0.0);
    }

    #[test]
    fn back_to_back_steps_merge_and_count_their_share_of_the_window() {
        let t0 = Instant::now();
        let mut m = BusyMeter::default();
        // 25 steps of 20 ms back to back: busy for 500 ms of the second that ends at t0 + 1 s.
        for i in 0..25 {
            m.record(t0 + MS * (20 * i), t0 + MS * (20 * (i + 1)));
        }
        assert_eq!(m.intervals.len(), 1);
        assert!((m.fraction(t0 + WINDOW) - 0.5).abs() < 1e-9);
        // Half a second later the window holds the last 0 ms of it.
        assert!((m.fraction(t0 + WINDOW + MS * 500)).abs() < 1e-9);
        // During the busy spell, the window started before the first step.
        assert!((m.fraction(t0 + MS * 250) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn gaps_count_as_idle_and_old_steps_are_dropped() {
        let t0 = Instant::now();
        let mut m = BusyMeter::default();
        // A 10 ms step every 40 ms: a quarter of the time.
        for i in 0..100 {
            m.record(t0 + MS * (40 * i), t0 + MS * (40 * i + 10));
        }
        let end = t0 + MS * 4000;
        assert!(
            (m.fraction(end) - 0.25).abs() < 0.011,
            "{}",
            m.fraction(end)
        );
        assert!(m.intervals.len() <= 27, "kept {}", m.intervals.len());
        // A fully busy engine reads 1, never more.
        m.record(end, end + WINDOW * 2);
        assert_eq!(m.fraction(end + WINDOW * 2), 1.0);
    }

    #[test]
    fn renders_every_gpu_with_the_exporters_names_and_labels() {
        let t0 = Instant::now();
        let mut m = BusyMeter::default();
        m.record(t0, t0 + MS * 300);
        let info = GpuInfo {
            gpus: 2,
            memory_mib: 45056.0,
            utilization: 0.9,
            serial: 7,
            hostname: "gpu-node".into(),
        };
        let page = render(&m, &info, t0 + WINDOW);
        for gpu in 0..2 {
            let labels = format!(
                "{{gpu=\"{gpu}\",UUID=\"GPU-00000007-0000-4000-8000-{gpu:012}\",device=\"nvidia{gpu}\",modelName=\"NVIDIA L40S (simulated)\",Hostname=\"gpu-node\"}}"
            );
            assert!(
                page.contains(&format!("DCGM_FI_PROF_GR_ENGINE_ACTIVE{labels} 0.3\n")),
                "{page}"
            );
            assert!(
                page.contains(&format!("DCGM_FI_DEV_GPU_UTIL{labels} 30\n")),
                "{page}"
            );
            assert!(
                page.contains(&format!("DCGM_FI_DEV_FB_USED{labels} 40550\n")),
                "{page}"
            );
            assert!(
                page.contains(&format!("DCGM_FI_DEV_FB_FREE{labels} 4506\n")),
                "{page}"
            );
        }
        assert_eq!(page.matches("# TYPE ").count(), 4);
    }
}
