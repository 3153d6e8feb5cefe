//! Switchyard: one OpenAI-compatible LLM serving platform in front of every GPU a company owns.
//!
//! The binary (`src/main.rs`) is a thin CLI over these modules: the server replica
//! ([`server`], [`http`], [`auth`], [`config`]), admission between a validated request and
//! its generation ([`admission`], over [`quota`]'s limits), storage and coordination ([`store`],
//! [`coord`]), the node agent ([`node_agent`]), the vLLM simulator ([`sim`]) and the embedded
//! demo fleet ([`demo`]), prompt token counting shared by the gateway and the simulator
//! ([`tokens`]), and the TLS every edge shares ([`tls`]: crypto provider, roots, PEM files).
//! The actors live in the `switchyard-actors` crate.

pub mod admission;
pub mod auth;
pub mod config;
pub mod coord;
pub mod demo;
pub mod env_names;
pub mod http;
pub mod jwt;
pub mod node_agent;
pub mod quota;
pub mod recent;
pub mod server;
pub mod sim;
pub mod store;
pub mod sweeper;
pub mod telemetry;
pub mod tls;
pub mod tokens;
