//! Switchyard's actors, their messages and their supervision.
//!
//! For now this crate holds the wire types shared by the server and the node agent
//! ([`protocol`]); the actors themselves (generation, node, model queue, team budget)
//! land here with the request path. The crate depends on no HTTP, SQL or Redis crate:
//! it reaches the world only through ports, so its tests run in-process.

pub mod protocol;
