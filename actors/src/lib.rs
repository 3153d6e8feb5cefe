//! Switchyard's actors, their messages and their supervision.
//!
//! The crate depends on no HTTP, SQL or Redis crate: it reaches the world only through
//! [`ports`], so its tests run in-process. [`protocol`] holds the node ⇄ server frames
//! shared by the server and `switchyard node`.

pub mod ports;
pub mod protocol;
