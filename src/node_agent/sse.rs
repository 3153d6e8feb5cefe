//! The engine's stream is parsed by the parser shared with the load harness
//! ([`switchyard_actors::sse`]), with its default bound of 1 MiB per event.

pub(crate) use switchyard_actors::sse::SseParser;
