//! Everything between a validated request and a generation ready to run: the idempotency
//! check, the per-principal limits, the lifecycle admission (message window, burst bucket,
//! active generations, with the model switch of a readmission), measuring, pricing and the
//! ledger reservation, behind one entry point, [`Admission::admit`]. No HTTP here: refusals are
//! an [`AdmissionError`], which the HTTP layer renders.

mod error;
mod job;
mod measure;
mod policy;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;
use switchyard_actors::error::Failure;
use switchyard_actors::lifecycle::{Decision, Event, GenerationStore, NewGeneration, Status};
use switchyard_actors::model_queue::{ModelQueueHandle, RouteKey, RoutingStrategy};
use switchyard_actors::ports::admission::{Admit, Ready};
use switchyard_actors::ports::{Clock, Reservation, cost_of};

pub use error::AdmissionError;
pub use job::AdmissionRun;
pub use measure::{MeasureError, Measured, Prompt, measure};
pub use policy::policy;

use crate::auth::Principal;
use crate::config::{Config, ModelConfig};
use crate::quota::Limits;
use crate::store::Store;
use crate::tokens::PromptCounter;
use switchyard_actors::tier::Tier;

/// A validated request, whichever API it came in on: what admission decides on.
#[derive(Debug)]
pub struct Request {
    /// Who asks.
    pub principal: Principal,
    /// The model version the request resolved to.
    pub model: ModelConfig,
    /// The body the engine gets (model resolved, max_tokens set).
    pub engine_body: Value,
    /// Output ceiling (the model's default when the client set none).
    pub max_tokens: u64,
    /// (Idempotency-Key, fingerprint of the normalized semantic inputs).
    pub idempotency: Option<(String, String)>,
    /// The engine API and what its prompt is.
    pub prompt: Prompt,
    /// The service tier it runs at (resolved against what its principal may use).
    pub tier: Tier,
}

/// Admits requests; one per replica, cheap to clone (a job holds one).
#[derive(Debug, Clone)]
pub struct Admission(Arc<Parts>);

/// What admission reads and writes.
#[derive(Debug)]
struct Parts {
    /// Models, prices, the message policy's defaults, the trust margins.
    config: Arc<Config>,
    /// The lifecycle records (idempotency, the message window) and the ledger.
    store: Arc<dyn Store>,
    /// The queue of every model, by resolved name: a readmission may switch queues.
    queues: BTreeMap<String, ModelQueueHandle>,
    /// The per-principal limits kept in the coordinator.
    limits: Limits,
    /// Each model's tokenizer, to measure prompts.
    prompts: PromptCounter,
    /// Time, for the message window and the records.
    clock: Arc<dyn Clock>,
}

impl Admission {
    /// Admission over these parts.
    pub fn new(
        config: Arc<Config>,
        store: Arc<dyn Store>,
        queues: BTreeMap<String, ModelQueueHandle>,
        limits: Limits,
        prompts: PromptCounter,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self(Arc::new(Parts {
            config,
            store,
            queues,
            limits,
            prompts,
            clock,
        }))
    }

    /// The admission of `request` under `id`, as a job a generation can run.
    pub fn job(&self, request: Request, id: &str) -> AdmissionRun {
        AdmissionRun::new(self.clone(), request, id)
    }

    /// Admits `request` under `id`: a retry of a known request is answered from its record
    /// (it costs nothing), anything else passes the limits, its lifecycle admission and its
    /// measure, and leaves with its reservation. On a refusal, what was taken is given back
    /// (the stream place's [`EndHook`](switchyard_actors::generation::EndHook) runs on drop).
    pub async fn admit(&self, mut request: Request, id: &str) -> Result<Admit, AdmissionError> {
        let parts = &self.0;
        let policy = policy(&parts.config, &request.principal);
        // Whoever sent a key can come back with it; an automatic one is nobody's.
        let resumable = request.idempotency.is_some();
        // A principal whose messages are metered goes through a record even without a key:
        // the quota and the bucket are only exact inside the record's transaction. The key is
        // the request's own id, so it is never replayed.
        if request.idempotency.is_none() && policy.meters_messages() {
            request.idempotency = Some((format!("auto:{id}"), String::new()));
        }
        if let Some(existing) = self.known(&request).await? {
            return Ok(Admit::Existing(Box::new(existing)));
        }
        let mut queue = parts
            .queues
            .get(&request.model.name)
            .cloned()
            .ok_or(AdmissionError::ModelNotServed)?;
        let (limits, on_end) = parts.limits.admit(&request.principal, id).await?;
        // Tokenizing is CPU work: only for a request the limits let through.
        let mut measured = self
            .measure(&request)
            .await
            .map_err(|error| AdmissionError::Measure { error, limits })?;
        let mut id = id.to_owned();
        let mut ledger_id = id.clone();
        let mut lifecycle = None;
        if let Some((key, fp)) = &request.idempotency {
            let new = NewGeneration {
                id: id.clone(),
                subject: request.principal.subject.clone(),
                idempotency_key: key.clone(),
                fingerprint: fp.clone(),
                model: request.model.name.clone(),
            };
            let now_ms = parts.clock.wall().timestamp_millis();
            let decision = parts
                .store
                .admit_generation(&new, &policy, now_ms)
                .await
                .map_err(|e| {
                    tracing::error!(error = %e, "the lifecycle admission failed");
                    AdmissionError::StoreUnavailable
                })?;
            let secs = |ms: i64| u64::try_from(ms.max(0)).unwrap_or(0).div_ceil(1000).max(1);
            let rec = match decision {
                Decision::Admitted(rec) => rec,
                Decision::Existing(rec) => return Ok(Admit::Existing(Box::new(rec))),
                Decision::Conflict(rec) => {
                    return Err(AdmissionError::Conflict {
                        generation_id: rec.id,
                        limits: Some(limits),
                    });
                }
                Decision::RateLimited { retry_after_ms } => {
                    let retry_after_secs = secs(retry_after_ms);
                    return Err(AdmissionError::Burst {
                        retry_after_secs,
                        limits,
                    });
                }
                Decision::ConcurrencyLimited { limit } => {
                    return Err(AdmissionError::Active { limit, limits });
                }
                Decision::QuotaExhausted {
                    limit,
                    remaining,
                    reset_at_ms,
                } => {
                    return Err(AdmissionError::Messages {
                        limit,
                        remaining,
                        reset_at_ms,
                        retry_after_secs: secs(reset_at_ms - now_ms),
                        limits,
                    });
                }
            };
            if rec.model != request.model.name {
                // Admitted again under the model version stored with the request, not the one
                // its alias names today; a refusal here rejects the record it readmitted.
                let reject = |code: &str| Event::Reject { code: code.into() };
                let stored = parts.config.models.iter().find(|m| m.name == rec.model);
                let (Some(stored), Some(stored_queue)) = (stored, parts.queues.get(&rec.model))
                else {
                    let err = AdmissionError::StoredModelGone;
                    let gone = reject(Failure::from(err.clone()).code.as_str());
                    let _ = parts.store.apply_generation(&rec.id, &gone, now_ms).await;
                    return Err(err);
                };
                if let Value::Object(body) = &mut request.engine_body {
                    body.insert("model".into(), Value::String(rec.model.clone()));
                }
                request.model = stored.clone();
                queue = stored_queue.clone();
                // Counted again with the stored version's tokenizer and context.
                measured = match self.measure(&request).await {
                    Ok(m) => m,
                    Err(error) => {
                        let err = AdmissionError::Measure { error, limits };
                        let gone = reject(Failure::from(err.clone()).code.as_str());
                        let _ = parts.store.apply_generation(&rec.id, &gone, now_ms).await;
                        return Err(err);
                    }
                };
            }
            // A readmission's row has a key of its own (the first one is final).
            ledger_id.clone_from(&rec.ledger_id);
            id = rec.id;
            let store: Arc<dyn GenerationStore> = parts.store.clone();
            lifecycle = Some(store);
        }
        let route = route(&request.model, &measured);
        let reservation = reservation(&request, ledger_id, measured);
        Ok(Admit::Ready(Box::new(Ready {
            request_id: id,
            embedding_dimensions: request.model.embedding_dimensions,
            model: request.model.name,
            body: request.engine_body,
            reservation,
            queue,
            route,
            lifecycle,
            resumable,
            tier: request.tier,
            on_end,
            limits,
        })))
    }

    /// The record a repeated key names, when it may answer the request (anything but a
    /// rejected one, which is admitted again); a key used for another request is refused.
    async fn known(
        &self,
        request: &Request,
    ) -> Result<Option<switchyard_actors::lifecycle::GenerationRecord>, AdmissionError> {
        let Some((key, fp)) = &request.idempotency else {
            return Ok(None);
        };
        let found = self
            .0
            .store
            .find_generation(&request.principal.subject, key)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "an idempotency lookup failed");
                AdmissionError::StoreUnavailable
            })?;
        match found {
            Some(rec) if &rec.fingerprint != fp => Err(AdmissionError::Conflict {
                generation_id: rec.id,
                limits: None,
            }),
            Some(rec) if rec.status != Status::Rejected => Ok(Some(rec)),
            _ => Ok(None),
        }
    }

    async fn measure(&self, request: &Request) -> Result<Measured, MeasureError> {
        // Only cache_aware routing reads a prompt's blocks: the others are not worth hashing.
        let block_size = if self.0.config.routing == RoutingStrategy::CacheAware {
            request.model.block_size
        } else {
            0
        };
        measure(
            &self.0.prompts,
            &self.0.config.trust,
            &request.model,
            &request.engine_body,
            &request.prompt,
            request.max_tokens,
            block_size,
        )
        .await
    }
}

/// What the queue routes a request on: its prompt's blocks (none when it was not tokenized).
fn route(model: &ModelConfig, measured: &Measured) -> Option<Arc<RouteKey>> {
    (!measured.blocks.is_empty()).then(|| {
        Arc::new(RouteKey {
            blocks: measured.blocks.as_slice().into(),
            block_size: model.block_size,
            prompt_tokens: u32::try_from(measured.prompt_tokens).unwrap_or(u32::MAX),
            session: None,
        })
    })
}

/// The ledger row a request opens: its measured prompt and output ceiling at the model's
/// prices, bounded by what a node may bill.
fn reservation(request: &Request, ledger_id: String, measured: Measured) -> Reservation {
    let (pin, pout) = (
        request.model.price_input_per_mtok,
        request.model.price_output_per_mtok,
    );
    Reservation {
        request_id: ledger_id,
        team_id: request.principal.team_id,
        key_id: request.principal.key_id,
        model: request.model.name.clone(),
        estimated_prompt_tokens: measured.prompt_tokens,
        max_tokens: request.max_tokens,
        estimated_cost: cost_of(measured.prompt_tokens, request.max_tokens, pin, pout),
        price_input_per_mtok: pin,
        price_output_per_mtok: pout,
        bounds: measured.bounds,
    }
}
