//! Switchyard: one OpenAI-compatible LLM serving platform in front of every GPU a company owns.
//!
//! The binary (`src/main.rs`) is a thin CLI over these modules. Today the crate holds the vLLM
//! simulator ([`sim`]); the gateway, orchestrator, storage and node agent join it.

pub mod sim;
