//! The [`GenerationActor`]: a thin shell around the pure core in `core/`. It turns each
//! [`GenerationMsg`] into a core input and carries out the effects the core returns.
//!
//! I/O is awaited in the handler, one effect at a time, and its answer is stepped at once,
//! before the rest of the batch and before any other message. So the core sees its I/O in
//! exactly the order it asked for and never has to reason about two answers crossing, while
//! nothing waits inside a handler beyond one I/O call: the settle backoff is a timer, so
//! cancels and deadlines are handled between tries.

use std::collections::VecDeque;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::core::{Claim, Config, Core, Effect, Input, Metric, NodeRef, Where};
use super::directory::Directory;
use super::msg::{GenerationArgs, GenerationMsg};
use crate::error::Failure;
use crate::lifecycle::{Event, Refusal};
use crate::metric_names::{
    ACTIVE_STREAMS, OUTPUT_TOKENS_PER_SECOND, QUEUE_WAIT_SECONDS, REQUESTS_TOTAL,
    SLOW_READERS_TOTAL, STALE_FRAMES_TOTAL, TTFT_SECONDS, USAGE_CLAMPED_TOTAL,
};
use crate::model_queue::{Ask, Slot};
use crate::node::{NodeHandle, Work};
use crate::ports::Settlement;
use crate::tasks::TaskGuard;

impl NodeRef for NodeHandle {
    fn node_id(&self) -> &str {
        NodeHandle::node_id(self)
    }
}

/// The actor's state: the core, and what it needs to carry out the core's effects.
#[derive(Debug)]
pub struct GenerationState {
    /// The generation's logic and state.
    core: Core<NodeHandle>,
    /// The request and the ports its effects go through.
    args: GenerationArgs,
    /// Where live generations are found by request id (a resent `done` looks here).
    directory: Directory,
    /// The admission's reply port, until the core answers it.
    admit_reply: Option<RpcReplyPort<Result<(), Failure>>>,
    /// Armed deadlines, aborted when the actor stops.
    timers: Vec<ractor::concurrency::JoinHandle<Result<(), ractor::MessagingErr<GenerationMsg>>>>,
    /// Node slots the queue counted for dispatches not yet handed to a node: each goes back
    /// when the core gives it up, or with the actor.
    slots: Vec<Slot>,
    /// Counts the live actor (leak detector).
    _guard: TaskGuard,
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationActor;

impl Actor for GenerationActor {
    type Msg = GenerationMsg;
    type State = GenerationState;
    type Arguments = (GenerationArgs, Directory);

    async fn pre_start(
        &self,
        myself: ActorRef<GenerationMsg>,
        (args, directory): (GenerationArgs, Directory),
    ) -> Result<GenerationState, ActorProcessingErr> {
        directory.insert(&args.request_id, myself);
        let cfg = Config {
            request_id: args.request_id.clone(),
            model: args.model.clone(),
            timeouts: args.timeouts,
            bounds: args.reservation.bounds,
            estimated_prompt_tokens: args.reservation.estimated_prompt_tokens,
            output_bytes: crate::output::output_bound(
                args.api,
                &args.body,
                args.reservation.bounds.completion_tokens,
                args.reservation.bounds.prompt_tokens,
                args.embedding_dimensions,
            ),
            recorded: args.lifecycle.is_some(),
            resumable: args.resumable && args.lifecycle.is_some(),
        };
        Ok(GenerationState {
            core: Core::new(cfg, args.clock.now()),
            args,
            directory,
            admit_reply: None,
            timers: Vec::new(),
            slots: Vec::new(),
            _guard: TaskGuard::new("generation"),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<GenerationMsg>,
        msg: GenerationMsg,
        state: &mut GenerationState,
    ) -> Result<(), ActorProcessingErr> {
        let input = match msg {
            GenerationMsg::Admit(reply) => {
                // A second `Admit` is answered by its dropped port: the caller sees an error,
                // never a hang. The first one's port is kept until the core answers it (after
                // the row committed), or dropped with the actor.
                if matches!(state.core.at, Where::New) {
                    state.admit_reply = Some(reply);
                }
                Input::Admit
            }
            GenerationMsg::Reserved(result) => Input::Reserved(result),
            GenerationMsg::Dispatch { node, slot } => {
                state.slots.push(slot);
                Input::Dispatch { node }
            }
            GenerationMsg::QueueTimeout => Input::QueueTimeout,
            GenerationMsg::Accepted { attempt, from } => Input::Accepted { attempt, from },
            GenerationMsg::Chunk {
                attempt,
                seq,
                delta,
                from,
            } => Input::Chunk {
                attempt,
                seq,
                delta,
                from,
            },
            GenerationMsg::Done {
                attempt,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                chunks,
                finish_reason,
                from,
            } => Input::Done {
                attempt,
                claim: Claim {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    chunks,
                    finish_reason,
                },
                from,
            },
            GenerationMsg::EngineError {
                attempt,
                code,
                message,
                from,
            } => Input::EngineError {
                attempt,
                code,
                message,
                from,
            },
            GenerationMsg::NodeLost { attempt } => Input::NodeLost { attempt },
            GenerationMsg::NodeGone { node_id } => Input::NodeGone { node_id },
            GenerationMsg::QueueRestarted { model } => Input::QueueRestarted { model },
            GenerationMsg::ClientGone => Input::ClientGone,
            GenerationMsg::ClientBack => Input::ClientBack,
            GenerationMsg::RecordAgain => Input::RecordAgain,
            GenerationMsg::Cancel => Input::Cancel,
            GenerationMsg::Timer(timer) => Input::Timer(timer),
        };
        state.run(&myself, input).await;
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<GenerationMsg>,
        state: &mut GenerationState,
    ) -> Result<(), ActorProcessingErr> {
        for t in state.timers.drain(..) {
            t.abort();
        }
        // The safety net: an unreleased row of a generation that never ran is released, an
        // untold client is told, the gauge comes down.
        state.run(&myself, Input::Stopped).await;
        for t in state.timers.drain(..) {
            t.abort();
        }
        state
            .directory
            .remove(&state.args.request_id, myself.get_id());
        if let Some(hook) = state.args.on_end.take() {
            hook.run(state.core.settled_tokens());
        }
        Ok(())
    }
}

/// The slot counted for a dispatch to `node_id`, if one is held.
fn take_slot(slots: &mut Vec<Slot>, node_id: &str) -> Option<Slot> {
    let i = slots.iter().position(|s| s.node_id() == node_id)?;
    Some(slots.swap_remove(i))
}

impl GenerationState {
    /// Steps the core with `input` and carries out its effects in order, stepping each
    /// answer at once (its effects go before the rest of the batch); then the inputs the core
    /// held while its row was being opened, one batch each, before any new message.
    async fn run(&mut self, myself: &ActorRef<GenerationMsg>, input: Input<NodeHandle>) {
        let mut next = Some(input);
        while let Some(input) = next {
            let now = self.args.clock.now();
            let mut todo: VecDeque<Effect<NodeHandle>> = self.core.step(input, now).into();
            while let Some(effect) = todo.pop_front() {
                if let Some(answer) = self.carry_out(myself, effect).await {
                    let now = self.args.clock.now();
                    for e in self.core.step(answer, now).into_iter().rev() {
                        todo.push_front(e);
                    }
                }
            }
            next = self.core.next_held();
        }
    }

    /// Carries out one effect; the answer, for those that have one.
    async fn carry_out(
        &mut self,
        myself: &ActorRef<GenerationMsg>,
        effect: Effect<NodeHandle>,
    ) -> Option<Input<NodeHandle>> {
        let request_id = &self.args.request_id;
        match effect {
            Effect::Reply(verdict) => {
                if let Some(reply) = self.admit_reply.take() {
                    let _ = reply.send(verdict);
                }
                None
            }
            Effect::Reserve => {
                // Beside the rest of admission and the dispatch; the answer is a message. The
                // task is not aborted with the actor: a reservation in flight finishes, and a
                // row nobody answers for is the sweeper's (or settled by the node's `done`).
                let (ledger, reservation) =
                    (self.args.ledger.clone(), self.args.reservation.clone());
                let me = myself.clone();
                tokio::spawn(async move {
                    let result = ledger.reserve(&reservation).await;
                    let _ = me.cast(GenerationMsg::Reserved(result));
                });
                None
            }
            Effect::RecordHolders(holders) => {
                Some(Input::HoldersRecorded(self.record_holders(&holders).await))
            }
            Effect::Enqueue { front, avoid } => {
                let queue = self.args.queue.clone();
                let result = queue
                    .enqueue(
                        request_id,
                        myself.clone(),
                        Ask {
                            front,
                            avoid,
                            api: self.args.api,
                            route: self.args.route.clone(),
                            ticket: self.args.ticket(),
                        },
                    )
                    .await;
                Some(Input::Enqueued(result))
            }
            Effect::Withdraw => {
                self.args.queue.withdraw(request_id);
                None
            }
            Effect::Record { event, answer } => {
                let result = self.record(event).await;
                answer.then_some(Input::Recorded(result))
            }
            Effect::Assign { node, attempt } => {
                let work = Work {
                    model: self.args.model.clone(),
                    body: self.args.body.clone(),
                    api: self.args.api,
                    x_request_id: self.args.x_request_id.clone(),
                    traceparent: self.args.traceparent.clone(),
                    tier: self.args.tier,
                };
                let lease_ms = u64::try_from(self.args.timeouts.lease.as_millis()).ok();
                let sent = node.assign(request_id, attempt, work, lease_ms, myself.clone());
                if sent && let Some(slot) = take_slot(&mut self.slots, node.node_id()) {
                    // The node's in-flight entry gives it back when the assignment ends.
                    slot.handed_over();
                }
                if sent {
                    tracing::debug!(request_id = %request_id, node_id = node.node_id(), attempt, "dispatched");
                }
                Some(Input::Assigned(sent))
            }
            Effect::CancelOnNode { node, attempt } => {
                node.cancel(request_id, attempt);
                None
            }
            Effect::Ack { node, attempt } => {
                node.ack(request_id, attempt);
                None
            }
            Effect::Violation { node, kind } => {
                node.violation(kind, Some(request_id));
                None
            }
            Effect::ReleaseSlot(node_id) => {
                // Dropped: back to the queue that counted it.
                drop(take_slot(&mut self.slots, &node_id));
                None
            }
            Effect::Settle {
                prompt_tokens,
                completion_tokens,
                review,
                node_id,
            } => {
                let settlement = Settlement {
                    request_id: self.args.reservation.request_id.clone(),
                    prompt_tokens,
                    completion_tokens,
                    review,
                    node_id,
                };
                Some(Input::Settled(self.args.ledger.settle(&settlement).await))
            }
            Effect::LookUpRow => Some(Input::RowLookedUp(
                self.args
                    .ledger
                    .entry(&self.args.reservation.request_id)
                    .await,
            )),
            Effect::CancelRow => {
                let cancelled = self
                    .args
                    .ledger
                    .cancel(&self.args.reservation.request_id)
                    .await;
                if let Err(e) = &cancelled {
                    tracing::error!(request_id = %request_id, error = %e, "could not cancel the ledger row");
                }
                Some(Input::RowCancelled(cancelled.is_ok()))
            }
            Effect::Tell(event) => {
                let now = self.args.clock.now();
                Some(Input::Told(self.args.events.send(event, now)))
            }
            Effect::Count(code) => {
                metrics::counter!(REQUESTS_TOTAL, "model" => self.args.model.clone(), "code" => code.as_str())
                    .increment(1);
                None
            }
            Effect::Metric(metric) => {
                self.metric(metric);
                None
            }
            Effect::ArmTimer { timer, after } => {
                self.timers
                    .push(myself.send_after(after, move || GenerationMsg::Timer(timer)));
                None
            }
            Effect::Stop => {
                myself.stop(None);
                None
            }
        }
    }

    fn metric(&self, metric: Metric) {
        let model = self.args.model.clone();
        match metric {
            Metric::StaleFrame(reason) => {
                metrics::counter!(STALE_FRAMES_TOTAL, "reason" => reason).increment(1)
            }
            Metric::QueueWait(secs) => {
                let tier = self.args.tier.as_str();
                metrics::histogram!(QUEUE_WAIT_SECONDS, "model" => model, "tier" => tier)
                    .record(secs);
            }
            Metric::Ttft(secs) => metrics::histogram!(TTFT_SECONDS, "model" => model).record(secs),
            Metric::OutputRate(rate) => {
                metrics::histogram!(OUTPUT_TOKENS_PER_SECOND, "model" => model).record(rate)
            }
            Metric::SlowReader => {
                metrics::counter!(SLOW_READERS_TOTAL, "model" => model).increment(1)
            }
            Metric::UsageClamped => {
                metrics::counter!(USAGE_CLAMPED_TOTAL, "model" => model).increment(1)
            }
            Metric::SettledTokens { prompt, completion } => {
                crate::metric_names::count_settled_tokens(model, prompt, completion);
            }
            Metric::ActiveStreams(true) => metrics::gauge!(ACTIVE_STREAMS).increment(1.0),
            Metric::ActiveStreams(false) => metrics::gauge!(ACTIVE_STREAMS).decrement(1.0),
        }
    }

    /// Applies `event` to the generation's record, if it has one. `None` when it has none
    /// or the store could not be reached (the sweeper reconciles it later).
    async fn record(&self, event: Event) -> Option<Result<(), Refusal>> {
        let store = self.args.lifecycle.as_ref()?;
        let now = self.args.clock.wall().timestamp_millis();
        match store
            .apply_generation(&self.args.request_id, &event, now)
            .await
        {
            Ok(applied) => {
                if let Err(refusal) = &applied.result {
                    tracing::debug!(request_id = %self.args.request_id, %refusal, "record refused a transition");
                }
                Some(applied.result.map(|_| ()))
            }
            Err(e) => {
                tracing::warn!(request_id = %self.args.request_id, error = %e, "could not record a transition");
                None
            }
        }
    }

    /// Writes that this generation was admitted and which node holds each attempt to the
    /// coordinator, so that a `done` arriving where this actor is not live is accepted only
    /// from its node. False when it could not be written: then nothing is sent.
    async fn record_holders(&self, holders: &std::collections::BTreeMap<u64, String>) -> bool {
        let Some(recorder) = &self.args.attempts else {
            return true;
        };
        let t = &self.args.timeouts;
        // The longest a `done` may arrive: the whole request, the wait for its usage, and the
        // sweeper's margin (the row is swept after that anyway).
        let ttl = t.total + t.settle_wait + Duration::from_secs(60);
        if let Err(e) = recorder.record(&self.args.request_id, holders, ttl).await {
            tracing::warn!(request_id = %self.args.request_id, error = %e, "could not record the attempt's node; not sending it");
            return false;
        }
        true
    }
}
