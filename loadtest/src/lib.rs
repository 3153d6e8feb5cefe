//! switchyard-loadtest: the client side of every Switchyard benchmark. Drives
//! any OpenAI-compatible chat completions endpoint with concurrent streaming
//! requests and reports TTFT, ITL, token rates and outcomes with their formulas.

pub mod config;
pub mod prompt;
pub mod report;
mod request;
pub mod run;
pub mod sse;

pub use config::{Limit, ModelWeight, RunConfig, assign_workers, parse_duration, parse_mix};
pub use prompt::Calibration;
pub use report::{
    ConfigSummary, FORMULAS, Figures, ModelAssignment, Percentiles, Report, RequestRecord,
};
pub use run::run;
pub use sse::{SseError, SseParser};
