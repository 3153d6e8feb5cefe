//! One [`GenerationActor`] per request: it owns the request's lifecycle — admitted and
//! reserved, queued, dispatched with an attempt epoch, streaming, terminal — relays the
//! node's frames to the HTTP layer as [`GenEvent`]s, and settles its ledger row on every
//! exit path. The decisions are a pure state machine (`core/`: `step(input, now)` returns
//! effects); the actor (`actor.rs`) only carries them out. [`Generations`] starts them under
//! a supervisor that settles what a crashed generation held; [`Launcher`] (`launch.rs`) is the
//! one path to one: the request's admission job first, then the generation it admitted.

mod actor;
mod core;
mod directory;
pub mod events;
mod launch;
mod msg;
mod supervisor;
#[cfg(test)]
mod tests;

pub use actor::GenerationActor;
pub use directory::Directory;
pub use events::{EventReceiver, EventSender, StreamBound};
pub use launch::{JOURNAL_MAX_BYTES, LaunchError, Launched, Launcher, Trace};
pub use msg::{EndHook, GenEvent, GenerationArgs, GenerationMsg, Timeouts, Usage};
pub use supervisor::{GenerationStream, GenerationSupervisor, Generations, SupervisorArgs};
