//! The one generation pipeline behind both API dialects: the idempotency check, the
//! per-principal limits, the lifecycle admission (message window, burst bucket, concurrent
//! generations, in one transaction with the request record), then the ledger reservation and
//! the model's queue. `/v1/chat/completions` enters it with an optional Idempotency-Key,
//! `/v1/generations` always with one; each renders the result in its own dialect.

use axum::http::HeaderMap;
use chrono::{TimeZone, Utc};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::{
    EventReceiver, GenEvent, GenerationArgs, GenerationStream, Usage, events,
};
use switchyard_actors::lifecycle::{
    Decision, Event, GenerationRecord, MessagePolicy, NewGeneration, Status,
};
use switchyard_actors::metric_names::REQUESTS_TOTAL;
use switchyard_actors::output::Assembled;
use switchyard_actors::ports::{Reservation, UsageBounds, cost_of};
use switchyard_actors::protocol::Api;

use super::error::ApiError;
use crate::auth::Principal;
use crate::config::{Config, ModelConfig};
use crate::quota::RateHeaders;
use crate::server::AppState;

/// Longest Idempotency-Key accepted.
const MAX_KEY_LEN: usize = 255;

/// A validated request, whichever dialect it came in.
#[derive(Debug)]
pub struct Plan {
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
    /// The client's request id, passed to the engine.
    pub x_request_id: Option<String>,
    /// The W3C trace context, passed to the engine.
    pub traceparent: Option<String>,
}

/// What an embeddings answer may hold unread between the generation and its handler.
const EMBEDDINGS_BUFFER_BYTES: usize = 256 << 20;

/// What a request's prompt is, to count it before admission.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// A chat body's `messages` (and the fields its template renders).
    Chat,
    /// Plain texts and client-tokenized ids: a legacy completion's `prompt`, an embeddings
    /// request's `input`.
    Texts {
        /// The engine API.
        api: Api,
        /// The texts.
        texts: Vec<String>,
        /// Inputs given as token ids: their lengths.
        token_lists: Vec<u64>,
        /// The body field they came from, for errors.
        param: &'static str,
    },
}

impl Prompt {
    /// The engine API the request runs on.
    pub fn api(&self) -> Api {
        match self {
            Prompt::Chat => Api::Chat,
            Prompt::Texts { api, .. } => *api,
        }
    }

    fn param(&self) -> &'static str {
        match self {
            Prompt::Chat => "messages",
            Prompt::Texts { param, .. } => param,
        }
    }
}

/// What the pipeline produced.
#[derive(Debug)]
pub enum Started {
    /// A generation is running; read its events.
    Running {
        /// Its events.
        generation: GenerationStream,
        /// Its id (the record's and the ledger row's).
        id: String,
        /// The limits' headers.
        rate: RateHeaders,
    },
    /// The key names an existing generation with the same fingerprint; it is not rerun.
    Existing(Box<GenerationRecord>),
}

/// The model a body's `model` names (a version or an alias), for both dialects.
pub fn resolve_model(
    state: &AppState,
    obj: &serde_json::Map<String, Value>,
) -> Result<ModelConfig, ApiError> {
    let name = obj
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::new(ErrorCode::InvalidRequest, "`model` is required."))?;
    state.config.resolve_model(name).cloned().ok_or_else(|| {
        ApiError::new(
            ErrorCode::ModelNotFound,
            format!("The model `{name}` does not exist."),
        )
    })
}

/// What the gateway counted of a request's prompt, and what that allows a node to bill.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// The messages' tokens through the model's template: the reservation's estimate.
    pub prompt_tokens: u64,
    /// The most a node may report (SPEC section 7, trust).
    pub bounds: UsageBounds,
}

/// Counts the prompt of `body` with the model's tokenizer and chat template: a prompt that
/// fills the model's context is refused here, before it costs a GPU anything; the count
/// plus the configured margin (and the tokens of tool definitions and other non-text fields
/// an engine's template may render) bounds the prompt tokens a node may bill, and
/// min(`max_tokens`, context) the completion tokens.
pub async fn measure(
    state: &AppState,
    model: &ModelConfig,
    body: &serde_json::Map<String, Value>,
    prompt: &Prompt,
    max_tokens: u64,
) -> Result<Measured, ApiError> {
    let context = u64::from(model.max_context_tokens);
    let param = prompt.param();
    let counted = match prompt {
        Prompt::Chat => state.prompts.count_chat(&model.name, body, context).await,
        Prompt::Texts {
            api,
            texts,
            token_lists,
            ..
        } => {
            // Each embedding input is its own sequence; a completion's prompt is one.
            let each = *api == Api::Embeddings;
            let (texts, lists) = (texts.clone(), token_lists.clone());
            state
                .prompts
                .count_texts(&model.name, texts, lists, context, each)
                .await
        }
    };
    let count = match counted {
        Some(Ok(count)) => count,
        Some(Err(crate::tokens::TokenizerError::Template(_))) => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "The messages cannot be rendered with the model's chat template.",
            )
            .with_param("messages"));
        }
        Some(Err(e)) => {
            // The kind only: the tokenizer's message may quote the prompt.
            tracing::error!(model = %model.name, kind = e.kind(), "counting a prompt failed");
            return Err(ApiError::unavailable(
                "The prompt could not be counted; nothing was started.",
            ));
        }
        None => {
            tracing::error!(model = %model.name, "no tokenizer loaded for a configured model");
            return Err(ApiError::unavailable(
                "The prompt could not be counted; nothing was started.",
            ));
        }
    };
    // An embedding has no output: each input may fill the context.
    let (counted, room_needed) = match prompt.api() {
        Api::Embeddings => (count.largest, 0),
        _ => (count.messages, 1),
    };
    if counted.saturating_add(room_needed) > context {
        let at_least = if count.at_least { "at least " } else { "" };
        return Err(ApiError::new(
            ErrorCode::ContextLengthExceeded,
            format!(
                "This model's maximum context length is {context} tokens; the `{param}` count {at_least}{counted} tokens, which leaves no room for output.",
            ),
        )
        .with_param(param));
    }
    let trust = &state.config.trust;
    let counted = count.messages.saturating_add(count.extra);
    let margin = (counted.saturating_mul(u64::from(trust.prompt_margin_percent)) / 100)
        .max(u64::from(trust.prompt_margin_tokens));
    Ok(Measured {
        prompt_tokens: count.messages,
        bounds: UsageBounds {
            prompt_tokens: counted.saturating_add(margin),
            completion_tokens: max_tokens.min(context),
        },
    })
}

/// [`measure`] of a plan's engine body.
async fn measure_plan(state: &AppState, plan: &Plan) -> Result<Measured, ApiError> {
    let Value::Object(body) = &plan.engine_body else {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "The body must be a JSON object.",
        ));
    };
    measure(state, &plan.model, body, &plan.prompt, plan.max_tokens).await
}

/// The most output tokens a request may ask for: the model's context.
pub fn check_max_tokens(model: &ModelConfig, field: &str, n: u64) -> Result<u64, ApiError> {
    let context = u64::from(model.max_context_tokens);
    if n == 0 || n > context {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!(
                "`{field}` must be an integer from 1 to the model's context length ({context})."
            ),
        )
        .with_param(field));
    }
    Ok(n)
}

/// The request's id (the client's `x-request-id`, or the one minted for it), for the engine.
pub fn client_request_id() -> Option<String> {
    super::request_id::current().map(|id| id.as_str().to_owned())
}

/// The W3C `traceparent` to continue at the engine: the access layer leaves only a
/// well-formed one on the request (the gateway's own span's when tracing is exported).
pub fn traceparent(headers: &HeaderMap) -> Option<String> {
    super::request_id::TraceContext::from_headers(headers)
        .traceparent()
        .map(str::to_owned)
}

/// The optional `Idempotency-Key` header: 1 to 255 visible ASCII characters, sent once.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`Idempotency-Key` was sent more than once; send it once.",
        )
        .with_param("Idempotency-Key"));
    }
    let key = value
        .to_str()
        .ok()
        .filter(|k| {
            !k.is_empty() && k.len() <= MAX_KEY_LEN && k.bytes().all(|b| b.is_ascii_graphic())
        })
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                "`Idempotency-Key` must be 1 to 255 visible ASCII characters.",
            )
        })?;
    Ok(Some(key.to_owned()))
}

/// SHA-256 (hex) of `v` with object keys sorted at every level: the same request gives the
/// same fingerprint whatever the order of its fields. Only the digest is stored.
pub fn fingerprint(v: &Value) -> String {
    let mut text = String::new();
    canonical(v, &mut text);
    hex::encode(Sha256::digest(text.as_bytes()))
}

fn canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                if let Some(child) = map.get(*k) {
                    canonical(child, out);
                }
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The principal's message policy (SPEC section 6): what its key sets; otherwise a key (a
/// team's service) has no message quota, burst bucket or active-generation limit, and a JWT
/// principal (a person) gets the configured defaults (40 per 3 h, a bucket of 20 refilled one
/// per 3 s) and `jwt_max_streams` active generations.
pub fn policy(config: &Config, who: &Principal) -> MessagePolicy {
    let g = &config.generations;
    let person = who.key_id.is_none();
    let default = |value: u32| {
        if person {
            value
        } else {
            MessagePolicy::UNLIMITED
        }
    };
    let longest = config.timeouts.total_secs + config.timeouts.settle_wait_secs;
    MessagePolicy {
        limit: who.message_quota.unwrap_or(default(g.messages_per_window)),
        window_ms: i64::from(g.window_hours) * 3_600_000,
        burst_capacity: who.burst_capacity.unwrap_or(default(g.burst_capacity)),
        burst_refill_ms: i64::from(who.burst_refill_seconds.unwrap_or(g.burst_refill_secs)) * 1000,
        max_active: who.max_streams.unwrap_or(MessagePolicy::UNLIMITED),
        slot_ttl_ms: i64::try_from(longest.saturating_mul(1000)).unwrap_or(i64::MAX),
    }
}

fn store_unavailable() -> ApiError {
    ApiError::unavailable("Generations cannot be admitted right now; nothing was started.")
}

/// Runs the pipeline for `plan` under `id`. Refusals before a generation exists are counted
/// here; a generation counts its own outcome.
pub async fn start(state: &AppState, plan: Plan, id: &str) -> Result<Started, ApiError> {
    let (args, events, rate) = match admit(state, plan, id).await.inspect_err(count_refusal)? {
        Admission::Ready(args, events, rate) => (*args, events, rate),
        Admission::Existing(rec) => return Ok(Started::Existing(rec)),
    };
    let id = args.request_id.clone();
    let recorded = args.lifecycle.is_some();
    let generation = match state.generations.start_generation(args, events).await {
        Ok(g) => g,
        Err(failure) => {
            // The generation's own paths record their refusals; this covers one that could
            // not be spawned or answer (refused harmlessly when already recorded).
            if recorded {
                let reject = Event::Reject {
                    code: failure.code.as_str().into(),
                };
                let now_ms = state.clock.wall().timestamp_millis();
                let _ = state.store.apply_generation(&id, &reject, now_ms).await;
            }
            return Err(ApiError::from(failure).with_rate_headers(rate));
        }
    };
    Ok(Started::Running {
        generation,
        id,
        rate,
    })
}

/// Counts the answer to a repeated key (`replayed`, or its 409/410 code).
pub fn counted_replay(
    answer: Result<axum::response::Response, ApiError>,
) -> Result<axum::response::Response, ApiError> {
    let code = match &answer {
        Ok(_) => "replayed",
        Err(e) => e.failure.code.as_str(),
    };
    metrics::counter!(REQUESTS_TOTAL, "model" => "", "code" => code).increment(1);
    answer
}

/// Counts a request refused before it became a generation.
pub fn count_refusal(e: &ApiError) {
    metrics::counter!(REQUESTS_TOTAL, "model" => "", "code" => e.failure.code.as_str())
        .increment(1);
}

enum Admission {
    Ready(Box<GenerationArgs>, EventReceiver, RateHeaders),
    Existing(Box<GenerationRecord>),
}

async fn admit(state: &AppState, mut plan: Plan, id: &str) -> Result<Admission, ApiError> {
    let policy = policy(&state.config, &plan.principal);
    // A principal whose messages are metered goes through a record even without a key: the
    // quota and the bucket are only exact inside the record's transaction. The key is the
    // request's own id, so it is never replayed.
    if plan.idempotency.is_none() && policy.meters_messages() {
        plan.idempotency = Some((format!("auto:{id}"), String::new()));
    }
    let who = &plan.principal;
    // A retry of a known request costs nothing and is answered from its record.
    if let Some((key, fp)) = &plan.idempotency {
        let found = state
            .store
            .find_generation(&who.subject, key)
            .await
            .map_err(|_| store_unavailable())?;
        if let Some(rec) = found {
            if &rec.fingerprint != fp {
                return Err(conflict(&rec));
            }
            if rec.status != Status::Rejected {
                return Ok(Admission::Existing(Box::new(rec)));
            }
        }
    }
    let mut queue = state
        .queues
        .get(&plan.model.name)
        .cloned()
        .ok_or_else(|| ApiError::new(ErrorCode::ModelNotFound, "The model is not served."))?;
    let (rate, on_end) = state.limits.admit(who, id).await?;
    let give_back = |on_end: Option<switchyard_actors::generation::EndHook>| {
        if let Some(h) = on_end {
            h.run(None);
        }
    };
    // Tokenizing is CPU work: only for a request the limits let through.
    let mut measured = match measure_plan(state, &plan).await {
        Ok(m) => m,
        Err(e) => {
            give_back(on_end);
            return Err(e.with_rate_headers(rate));
        }
    };
    let mut id = id.to_owned();
    let mut ledger_id = id.clone();
    let mut lifecycle = None;
    if let Some((key, fp)) = &plan.idempotency {
        let new = NewGeneration {
            id: id.clone(),
            subject: who.subject.clone(),
            idempotency_key: key.clone(),
            fingerprint: fp.clone(),
            model: plan.model.name.clone(),
        };
        let now_ms = state.clock.wall().timestamp_millis();
        let decision = match state.store.admit_generation(&new, &policy, now_ms).await {
            Ok(d) => d,
            Err(_) => {
                give_back(on_end);
                return Err(store_unavailable());
            }
        };
        match decision {
            Decision::Admitted(rec) => {
                if rec.model != plan.model.name {
                    // Admitted again under the model version stored with the request, not the
                    // one its alias names today.
                    let stored = state.config.models.iter().find(|m| m.name == rec.model);
                    let stored_queue = state.queues.get(&rec.model);
                    let (Some(stored), Some(stored_queue)) = (stored, stored_queue) else {
                        give_back(on_end);
                        let gone = Event::Reject {
                            code: ErrorCode::ModelNotFound.as_str().into(),
                        };
                        let _ = state.store.apply_generation(&rec.id, &gone, now_ms).await;
                        return Err(ApiError::new(
                            ErrorCode::ModelNotFound,
                            "The model version this request resolved to is no longer served.",
                        ));
                    };
                    if let Value::Object(body) = &mut plan.engine_body {
                        body.insert("model".into(), Value::String(rec.model.clone()));
                    }
                    plan.model = stored.clone();
                    queue = stored_queue.clone();
                    // Counted again with the stored version's tokenizer and context.
                    measured = match measure_plan(state, &plan).await {
                        Ok(m) => m,
                        Err(e) => {
                            give_back(on_end);
                            let gone = Event::Reject {
                                code: e.failure.code.as_str().into(),
                            };
                            let _ = state.store.apply_generation(&rec.id, &gone, now_ms).await;
                            return Err(e.with_rate_headers(rate));
                        }
                    };
                }
                // A readmission's row has a key of its own (the first one is final).
                ledger_id.clone_from(&rec.ledger_id);
                id = rec.id;
            }
            other => {
                give_back(on_end);
                return match other {
                    Decision::Existing(rec) => Ok(Admission::Existing(Box::new(rec))),
                    refusal => Err(refused(refusal, now_ms).with_rate_headers(rate)),
                };
            }
        }
        let generations: std::sync::Arc<dyn switchyard_actors::lifecycle::GenerationStore> =
            state.store.clone();
        lifecycle = Some(generations);
    }
    let (pin, pout) = (
        plan.model.price_input_per_mtok,
        plan.model.price_output_per_mtok,
    );
    let reservation = Reservation {
        request_id: ledger_id,
        team_id: who.team_id,
        key_id: who.key_id,
        model: plan.model.name.clone(),
        estimated_prompt_tokens: measured.prompt_tokens,
        max_tokens: plan.max_tokens,
        estimated_cost: cost_of(measured.prompt_tokens, plan.max_tokens, pin, pout),
        price_input_per_mtok: pin,
        price_output_per_mtok: pout,
        bounds: measured.bounds,
    };
    let mut bound = state.config.stream_bound();
    if plan.prompt.api() == Api::Embeddings {
        // One answer the handler collects at once, as large as its inputs make it (the agent
        // sends it in slices): the slow-reader bound is for streams read over a network.
        bound.max_bytes = bound.max_bytes.max(EMBEDDINGS_BUFFER_BYTES);
    }
    let (tx, events) = events::channel(bound);
    let args = GenerationArgs {
        request_id: id.clone(),
        model: plan.model.name.clone(),
        body: plan.engine_body,
        api: plan.prompt.api(),
        // Unique per generation: vLLM takes the header as its own request id, and two clients
        // may send the same one; the client's id leads, so the engine's logs find it.
        x_request_id: plan.x_request_id.map(|client| format!("{client}.{id}")),
        traceparent: plan.traceparent,
        reservation,
        queue,
        ledger: state.store.clone(),
        events: tx,
        timeouts: state.config.generation_timeouts(),
        clock: state.clock.clone(),
        on_end,
        lifecycle,
        coordinator: Some(state.coordinator.clone()),
    };
    Ok(Admission::Ready(Box::new(args), events, rate))
}

/// 409 `idempotency_conflict`: the key was used for a different request.
pub fn conflict(rec: &GenerationRecord) -> ApiError {
    let mut err = ApiError::new(
        ErrorCode::IdempotencyConflict,
        "This Idempotency-Key was used with a different request.",
    );
    err.details = Some(Box::new(json!({ "generation_id": rec.id })));
    err
}

/// 409 `generation_in_progress` with the running generation's id and status.
pub fn in_progress(rec: &GenerationRecord) -> ApiError {
    let mut err = ApiError::new(
        ErrorCode::GenerationInProgress,
        "A generation with this Idempotency-Key is still running.",
    );
    err.details = Some(Box::new(
        json!({ "generation_id": rec.id, "status": rec.api_status() }),
    ));
    err
}

/// 410 `result_unavailable`: the generation is known, its content expired.
pub fn expired(rec: &GenerationRecord) -> ApiError {
    let mut err = ApiError::new(
        ErrorCode::ResultUnavailable,
        "The generation's result is no longer retained.",
    );
    err.details = Some(Box::new(
        json!({ "generation_id": rec.id, "status": rec.api_status() }),
    ));
    err
}

/// A repeated key's answer, in either dialect: the retained output (text, reasoning, tool
/// calls) and the generation's end
/// (a failure as [`GenEvent::Failed`] with its recorded code); 409 while it still runs, 410
/// once its result is gone.
pub fn replayable(
    state: &AppState,
    rec: &GenerationRecord,
) -> Result<(Assembled, GenEvent), ApiError> {
    if !rec.status.is_terminal() {
        return Err(in_progress(rec));
    }
    if !retained(state, rec, state.clock.wall().timestamp_millis()) {
        return Err(expired(rec));
    }
    let usage = Usage {
        prompt_tokens: rec.input_tokens,
        completion_tokens: rec.output_tokens,
        finish_reason: rec.finish_reason.clone().unwrap_or_else(|| "stop".into()),
        cached_tokens: None,
    };
    let end = match rec.status {
        Status::Completed => GenEvent::Finished(usage),
        Status::Cancelled => GenEvent::Cancelled(usage),
        _ => {
            let code = rec
                .error_code
                .as_deref()
                .and_then(ErrorCode::parse)
                .unwrap_or(ErrorCode::ModelBackendError);
            GenEvent::Failed(Failure::new(code, "This generation failed."))
        }
    };
    Ok((retained_output(rec), end))
}

/// A record's retained output, assembled.
pub fn retained_output(rec: &GenerationRecord) -> Assembled {
    Assembled::retained(
        rec.output.as_deref().unwrap_or_default(),
        rec.output_extra.as_deref(),
    )
}

/// Whether a terminal record's result is still retained at `now_ms` (a record ended from a
/// `done` resent after a restart never had its text).
pub fn retained(state: &AppState, rec: &GenerationRecord, now_ms: i64) -> bool {
    rec.output.is_some()
        && rec
            .terminal_ms
            .is_some_and(|t| t.saturating_add(state.config.retention_ms()) > now_ms)
}

fn rfc3339(ms: i64) -> Option<String> {
    Utc.timestamp_millis_opt(ms)
        .single()
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
}

/// The API answer to an admission refusal.
fn refused(decision: Decision, now_ms: i64) -> ApiError {
    let secs = |ms: i64| u64::try_from(ms.max(0)).unwrap_or(0).div_ceil(1000).max(1);
    match decision {
        Decision::RateLimited { retry_after_ms } => ApiError::from(
            Failure::new(
                ErrorCode::RateLimited,
                "Too many generations in a short burst.",
            )
            .retry_after(secs(retry_after_ms)),
        ),
        Decision::ConcurrencyLimited { limit } => {
            let mut err = ApiError::from(
                Failure::new(
                    ErrorCode::ConcurrencyLimited,
                    format!("{limit} generations are already active; wait for one to finish."),
                )
                .retry_after(1),
            );
            err.details = Some(Box::new(json!({ "limit": limit })));
            err
        }
        Decision::QuotaExhausted {
            limit,
            remaining,
            reset_at_ms,
        } => {
            let mut err = ApiError::from(
                Failure::new(
                    ErrorCode::QuotaExhausted,
                    "Your current message allowance has been used.",
                )
                .retry_after(secs(reset_at_ms - now_ms)),
            );
            err.details = Some(Box::new(json!({
                "limit": limit, "remaining": remaining, "reset_at": rfc3339(reset_at_ms),
            })));
            err
        }
        Decision::Conflict(rec) => conflict(&rec),
        Decision::Existing(rec) | Decision::Admitted(rec) => in_progress(&rec),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn fingerprints_ignore_field_order_and_see_every_value() {
        let a = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_output_tokens": 5});
        let b = json!({"max_output_tokens": 5, "messages": [{"content": "hi", "role": "user"}], "model": "small"});
        let c = json!({"model": "small", "messages": [{"role": "user", "content": "hi!"}], "max_output_tokens": 5});
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&c));
        assert_eq!(fingerprint(&a).len(), 64);
    }

    fn principal(key_id: Option<i64>) -> Principal {
        Principal {
            team_id: 1,
            key_id,
            subject: "s".into(),
            model_allowlist: None,
            rpm: None,
            max_streams: key_id.is_none().then_some(2),
            tokens_per_day: None,
            message_quota: None,
            burst_capacity: None,
            burst_refill_seconds: None,
            admin: false,
        }
    }

    #[test]
    fn keys_meter_no_messages_unless_set_and_people_get_the_defaults() {
        let config = Config::default();
        let service = policy(&config, &principal(Some(7)));
        assert!(!service.meters_messages());
        assert_eq!(service.max_active, MessagePolicy::UNLIMITED);
        let person = policy(&config, &principal(None));
        assert!(person.meters_messages());
        assert_eq!(
            (
                person.limit,
                person.burst_capacity,
                person.burst_refill_ms,
                person.max_active
            ),
            (40, 20, 3000, 2)
        );
        assert_eq!(person.window_ms, 3 * 3600 * 1000);
        let mut limited = principal(Some(7));
        limited.message_quota = Some(5);
        limited.max_streams = Some(3);
        let limited = policy(&config, &limited);
        assert!(limited.meters_messages());
        assert_eq!(
            (limited.limit, limited.burst_capacity, limited.max_active),
            (5, MessagePolicy::UNLIMITED, 3)
        );
    }

    #[test]
    fn idempotency_keys_are_bounded_visible_ascii() {
        let mut h = HeaderMap::new();
        assert_eq!(idempotency_key(&h).unwrap(), None);
        h.insert("idempotency-key", "abc-123".parse().unwrap());
        assert_eq!(idempotency_key(&h).unwrap().as_deref(), Some("abc-123"));
        h.insert("idempotency-key", "has space".parse().unwrap());
        assert!(idempotency_key(&h).is_err());
        h.insert("idempotency-key", "x".repeat(256).parse().unwrap());
        assert!(idempotency_key(&h).is_err());
        let mut twice = HeaderMap::new();
        twice.append("idempotency-key", "a".parse().unwrap());
        twice.append("idempotency-key", "a".parse().unwrap());
        assert_eq!(
            idempotency_key(&twice).unwrap_err().param.as_deref(),
            Some("Idempotency-Key")
        );
    }
}
