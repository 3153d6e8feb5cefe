//! One [`ModelQueueActor`] per model: a bounded queue of admitted generations, a deadline
//! for each, and the choice of the node that gets the next one. Nodes register with the
//! queues of the models they serve; every dispatch and release goes through here, so the
//! queue knows each node's in-flight count exactly, not from a 5-second-old heartbeat. In a
//! cluster one replica's queue decides for all of them ([`cluster`]).

mod actor;
mod carried;
pub mod cluster;
mod departed;
mod follow;
mod grant;
mod line;
mod msg;
mod owner;
mod predict;
mod routing;

pub use actor::{ModelQueueActor, NODES_RETURN_WITHIN, QueueArgs, QueueConfig};
pub use carried::Word;
pub use cluster::{QueueCluster, Role};
pub use line::Ticket;
pub(crate) use msg::Ask;
pub use msg::{ModelQueueHandle, NodeReport, QueueMsg, QueueStats, Slot};
pub use routing::{
    MAX_BLOCKS, NodeView, PrefixIndex, RouteKey, Router, RoutingStrategy, block_hashes,
};
