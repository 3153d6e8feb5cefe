//! The server's side of one connected GPU node: a [`NodeActor`] per WebSocket, on the
//! replica that holds the socket, and a proxy of it (the same actor over another [`Link`])
//! on every other replica. It relays frames between the node and the generations it
//! carries, counts its own in-flight work (heartbeats are 5 s old at best), publishes
//! heartbeats to the coordinator, and when the connection ends tells every generation it
//! carried that its node is lost.

mod actor;
mod frames;
mod link;
pub mod meter;
mod msg;
mod orphan;
mod squared;

pub use actor::{NodeActor, NodeArgs, NodeTrust, VIOLATIONS_KEPT, violations_key};
pub use link::Link;
pub use msg::{NodeHandle, NodeLoad, NodeMsg, Violation, Work};
#[cfg(test)]
pub(crate) use orphan::LOOK_AGAIN;
