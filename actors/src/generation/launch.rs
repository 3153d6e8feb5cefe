//! The one path from a validated request to a running generation: its admission job runs
//! first ([`AdmissionJob`]: idempotency, limits, the record, measuring, pricing), then the
//! generation it admitted is put together with what every generation of the replica shares
//! ([`Launcher`]) and started. The HTTP layer hands over the job and renders what comes
//! back; it never sees the pieces of a generation.

use std::sync::Arc;
use std::time::Duration;

use super::events::{self, Journal, JournalSpec, StreamBound, journal_key};
use super::msg::{GenerationArgs, Timeouts};
use super::supervisor::{GenerationStream, Generations};
use crate::error::Failure;
use crate::lifecycle::{Event, GenerationRecord};
use crate::model_queue::RouteKey;
use crate::ports::admission::{AdmissionJob, Admit, LimitState, Ready};
use crate::ports::{Clock, Coordinator, Ledger};
use crate::protocol::Api;

/// What an embeddings answer may hold unread between the generation and its handler: one
/// answer the handler collects at once, as large as its inputs make it (the agent sends it
/// in slices); the slow-reader bound is for streams read over a network.
const EMBEDDINGS_BUFFER_BYTES: usize = 256 << 20;

/// Encoded bytes of one generation's journal at most (four times the retained output's
/// bound: the engine's deltas as sent, with logprobs, take more than their text).
pub const JOURNAL_MAX_BYTES: usize = 4 << 20;

/// The request's trace ids, passed to the engine.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The client's request id (or the one minted for it).
    pub x_request_id: Option<String>,
    /// The W3C trace context to continue at the engine.
    pub traceparent: Option<String>,
    /// The client's conversation (`x-session-id`, hashed): a routing hint.
    pub session: Option<u64>,
}

/// The prompt's route key with the session named. A session alone still routes: for a
/// prompt that was not hashed into blocks (a completions prompt, a chat prompt shorter than
/// one block) the key carries admission's `prompt_tokens` estimate, against which the
/// session's node is credited (with no prompt tokens it would be credited nothing).
fn with_session(
    route: Option<Arc<RouteKey>>,
    session: Option<u64>,
    prompt_tokens: u64,
) -> Option<Arc<RouteKey>> {
    let Some(session) = session else {
        return route;
    };
    let mut route = route.unwrap_or_else(|| {
        Arc::new(RouteKey {
            prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            ..RouteKey::default()
        })
    });
    Arc::make_mut(&mut route).session = Some(session);
    Some(route)
}

/// What a launch produced.
#[derive(Debug)]
pub enum Launched {
    /// A generation is running; read its events.
    Running {
        /// Its events.
        generation: GenerationStream,
        /// Its id (the record's and the ledger row's).
        id: String,
        /// The limits' state, for the answer's headers.
        rate: LimitState,
    },
    /// The key names an existing generation with the same fingerprint; it is not rerun.
    Existing(Box<GenerationRecord>),
}

/// Why a launch produced no generation.
#[derive(Debug)]
pub enum LaunchError<E> {
    /// The admission refused, with its own typed error (the caller renders it fully).
    Refused(E),
    /// Admitted, but the generation refused or could not start (its row, its queue); the
    /// generation counted it.
    NotStarted {
        /// Why.
        failure: Failure,
        /// The limits' state, for the answer's headers.
        rate: LimitState,
    },
}

/// What every generation of one replica shares, and the handle that starts them.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// Starts generations under the supervision tree.
    pub generations: Generations,
    /// Where rows are reserved (each team's budget actor), settled and cancelled.
    pub ledger: Arc<dyn Ledger>,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// How far behind a stream's reader may fall.
    pub bound: StreamBound,
    /// How long a finished generation's result (and journal) is kept.
    pub retention: Duration,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// Cluster coordination (holders records, journals).
    pub coordinator: Arc<dyn Coordinator>,
    /// This replica, named in its generations' attempt records.
    pub replica_id: String,
}

impl Launcher {
    /// Runs `job`, then starts the generation it admitted. Refusals before a generation
    /// exists come back as the job's own error; a generation counts its own outcome.
    pub async fn launch<J: AdmissionJob>(
        &self,
        job: Box<J>,
        api: Api,
        trace: Trace,
    ) -> Result<Launched, LaunchError<J::Error>> {
        let ready = match job.run().await.map_err(LaunchError::Refused)? {
            Admit::Ready(ready) => *ready,
            Admit::Existing(rec) => return Ok(Launched::Existing(rec)),
        };
        let rate = ready.limits;
        let (args, events) = self.args(ready, api, trace);
        let id = args.request_id.clone();
        let lifecycle = args.lifecycle.clone();
        match self.generations.start_generation(args, events).await {
            Ok(generation) => Ok(Launched::Running {
                generation,
                id,
                rate,
            }),
            Err(failure) => {
                // The generation's own paths record their refusals; this covers one that
                // could not be spawned or answer (refused harmlessly when already recorded).
                if let Some(store) = lifecycle {
                    let reject = Event::Reject {
                        code: failure.code.as_str().into(),
                    };
                    let now_ms = self.clock.wall().timestamp_millis();
                    let _ = store.apply_generation(&id, &reject, now_ms).await;
                }
                Err(LaunchError::NotStarted { failure, rate })
            }
        }
    }

    /// The journal of a resumable generation `id` (one with a record): kept while it runs
    /// and for the result retention after it ends.
    pub fn journal(&self, id: &str) -> Journal {
        let t = &self.timeouts;
        let spec = JournalSpec {
            key: journal_key(id),
            running_ttl: t.total + t.settle_wait + self.retention,
            retention: self.retention,
            max_bytes: JOURNAL_MAX_BYTES,
        };
        Journal::spawn(self.coordinator.clone(), spec)
    }

    /// The one place a generation's arguments are put together: what admission decided, the
    /// request's trace ids, and what the replica's generations share.
    fn args(
        &self,
        ready: Ready,
        api: Api,
        trace: Trace,
    ) -> (GenerationArgs, events::EventReceiver) {
        let mut bound = self.bound;
        if api == Api::Embeddings {
            bound.max_bytes = bound.max_bytes.max(EMBEDDINGS_BUFFER_BYTES);
        }
        let (tx, events) = events::channel(bound);
        let id = ready.request_id;
        let estimated_prompt = ready.reservation.estimated_prompt_tokens;
        // A generation with a record can be come back to: every event it produces is
        // journaled (not an embedding: one answer, never streamed, computed again more
        // cheaply than kept).
        let tx = match &ready.lifecycle {
            Some(_) if api != Api::Embeddings => tx.journaled(self.journal(&id)),
            _ => tx,
        };
        let args = GenerationArgs {
            // Unique per generation: vLLM takes the header as its own request id, and two
            // clients may send the same one; the client's id leads, so the engine's logs
            // find it.
            x_request_id: trace.x_request_id.map(|client| format!("{client}.{id}")),
            request_id: id,
            model: ready.model,
            body: ready.body,
            api,
            embedding_dimensions: ready.embedding_dimensions,
            traceparent: trace.traceparent,
            reservation: ready.reservation,
            queue: ready.queue,
            route: with_session(ready.route, trace.session, estimated_prompt),
            ledger: self.ledger.clone(),
            events: tx,
            timeouts: self.timeouts,
            clock: self.clock.clone(),
            on_end: ready.on_end,
            lifecycle: ready.lifecycle,
            resumable: ready.resumable,
            tier: ready.tier,
            attempts: Some(crate::attempts::Recorder {
                coordinator: self.coordinator.clone(),
                replica_id: self.replica_id.clone(),
            }),
        };
        (args, events)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_session_without_blocks_routes_on_the_prompt_it_estimated() {
        let hashed = Arc::new(RouteKey {
            blocks: vec![1, 2].into(),
            block_size: 16,
            prompt_tokens: 40,
            session: None,
        });
        // No session: the route as it was.
        assert_eq!(
            with_session(Some(hashed.clone()), None, 50),
            Some(hashed.clone())
        );
        assert_eq!(with_session(None, None, 50), None);
        // A session joins the prompt's blocks.
        let both = with_session(Some(hashed.clone()), Some(7), 50).unwrap();
        assert_eq!(
            (both.session, both.prompt_tokens, both.blocks.len()),
            (Some(7), 40, 2)
        );
        // Alone, it carries the estimate: the session's node is credited against it.
        let alone = with_session(None, Some(7), 600).unwrap();
        assert_eq!((alone.session, alone.prompt_tokens), (Some(7), 600));
        assert!(alone.blocks.is_empty());
    }
}
