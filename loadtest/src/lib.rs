//! switchyard-loadtest: the client side of every Switchyard benchmark. Drives
//! any OpenAI-compatible chat completions endpoint with concurrent streaming
//! requests and reports TTFT, ITL, token rates and outcomes with their formulas.

pub mod bench;
pub mod compare;
pub mod config;
pub mod drill;
pub mod prompt;
pub mod report;
mod request;
pub mod routing;
pub mod run;

pub use compare::{CompareConfig, CompareReport, Role, compare};
pub use config::{Limit, ModelWeight, RunConfig, assign_workers, parse_duration, parse_mix};
pub use prompt::Calibration;
pub use report::{
    ConfigSummary, FORMULAS, Figures, ModelAssignment, Percentiles, Report, RequestRecord,
};
pub use run::{calibrate_models, run, run_calibrated};
/// The SSE parser, shared with the node agent; the harness allows events of up to 4 MiB.
pub use switchyard_actors::sse::{SseError, SseParser};

/// Largest event the harness accepts before calling a stream broken.
pub const MAX_EVENT_BYTES: usize = 4 << 20;
