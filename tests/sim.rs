//! Integration tests of `switchyard sim` over HTTP: wire fidelity against the real vLLM
//! captures, the Python `openai` SDK, time-scaled calibration, disconnects and faults.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

#[path = "sim/calibration.rs"]
mod calibration;
#[path = "sim/faults.rs"]
mod faults;
#[path = "sim/fixed.rs"]
mod fixed;
#[path = "sim/openai_extras.rs"]
mod openai_extras;
#[path = "sim/prefix.rs"]
mod prefix;
#[path = "sim/sdk.rs"]
mod sdk;
#[path = "sim/wire.rs"]
mod wire;
