//! Every metric name the server exports, in one place (SPEC section 10).

/// Histogram: time to first token, seconds, by `model`.
pub const TTFT_SECONDS: &str = "switchyard_ttft_seconds";
/// Histogram: output tokens per second of each stream, by `model`.
pub const OUTPUT_TOKENS_PER_SECOND: &str = "switchyard_output_tokens_per_second";
/// Histogram: seconds from admission to dispatch, by `model` and service `tier`.
pub const QUEUE_WAIT_SECONDS: &str = "switchyard_queue_wait_seconds";
/// Gauge: requests waiting in a model's queue (scales a model up from zero), by `model`.
pub const QUEUE_DEPTH: &str = "switchyard_queue_depth";
/// Counter: requests refused on arrival because the work before them would start them past
/// their tier's queue budget (503 `capacity_exhausted`), by `model` and `tier`.
pub const EARLY_REFUSALS_TOTAL: &str = "switchyard_queue_early_refusals_total";
/// Counter: dispatches by `model`, `tier` and `team`: the share each got of a model.
pub const QUEUE_DISPATCHES_TOTAL: &str = "switchyard_queue_dispatches_total";
/// Counter: requests by `model` and final `code` (`ok` or an error code).
pub const REQUESTS_TOTAL: &str = "switchyard_requests_total";
/// Gauge: streams being served now.
pub const ACTIVE_STREAMS: &str = "switchyard_active_streams";
/// Gauge: ledger rows still `reserved`.
pub const LEDGER_OPEN_RESERVATIONS: &str = "switchyard_ledger_open_reservations";
/// Gauge: a node's KV-cache use (0–1) from its heartbeat, by `node` and `model`.
pub const NODE_KV_CACHE_USAGE: &str = "switchyard_node_kv_cache_usage";
/// Gauge: nodes by `state` (`ready`, `draining`).
pub const NODES: &str = "switchyard_nodes";
/// Gauge: live actors and connection tasks (leak detector).
pub const TASKS_ALIVE: &str = "switchyard_tasks_alive";
/// Counter: frames dropped because they came from an older attempt, or duplicated a seq.
pub const STALE_FRAMES_TOTAL: &str = "switchyard_stale_frames_total";
/// Counter: streams cancelled because their reader fell behind the buffer bound.
pub const SLOW_READERS_TOTAL: &str = "switchyard_slow_readers_total";
/// Counter: frames a node sent that it had no right to send, by `node` and `kind`
/// (`foreign_request`, `seq_regression`, `usage_out_of_range`, `malformed_frame`, …).
pub const NODE_PROTOCOL_VIOLATIONS_TOTAL: &str = "switchyard_node_protocol_violations_total";
/// Counter: usage reports clamped to the request's bounds (their rows are marked for review),
/// by `model`.
pub const USAGE_CLAMPED_TOTAL: &str = "switchyard_usage_clamped_total";
/// Counter: connections closed at accept, by `reason` (`per_client_cap`).
pub const CONNECTIONS_REFUSED_TOTAL: &str = "switchyard_connections_refused_total";
/// Gauge: client connections open on the public listener.
pub const CONNECTIONS_OPEN: &str = "switchyard_connections_open";
/// Counter: requests the listener refused before they reached a handler, by `reason`
/// (`header_timeout`, `body_timeout`, `head_too_large`, `uri_too_long`, `malformed`).
pub const LISTENER_REFUSALS_TOTAL: &str = "switchyard_listener_refusals_total";
/// Counter: actors that crashed (a panic or an error out of a handler) and were contained by
/// their supervisor, by `kind` (`generation`, `node`, `model_queue`, `team_budget`,
/// `supervisor`), whether the policy restarted them or not.
pub const ACTOR_RESTARTS_TOTAL: &str = "switchyard_actor_restarts_total";
/// Counter: messages from a model queue's former owner dropped by their fencing token.
pub const QUEUE_FENCED_TOTAL: &str = "switchyard_queue_fenced_total";
/// Counter: times this replica found the coordinator's data lost (its epoch key changed or
/// vanished: Redis came back empty) and had its live generations record themselves again.
pub const COORDINATOR_DATA_LOST_TOTAL: &str = "switchyard_coordinator_data_lost_total";
/// Counter: slots a model queue counted on a node that the replica holding the node's socket
/// did not see it carry, given back (a release lost between replicas), by `model`.
pub const QUEUE_SLOTS_RECLAIMED_TOTAL: &str = "switchyard_queue_slots_reclaimed_total";
/// Counter: assignments the replica holding a node's socket counted on it that the node's
/// own heartbeat no longer lists (their `done` or `error` lost, or dropped by the agent),
/// ended as on a lost node and their slots given back, by `node` (`node::squared`).
pub const NODE_ASSIGNMENTS_RECLAIMED_TOTAL: &str = "switchyard_node_assignments_reclaimed_total";
/// Counter: tokens billed by successful settles, by `model` and `kind` (`prompt`,
/// `completion`); its rate against the engines' own token counters shows drift as it happens.
pub const SETTLED_TOKENS_TOTAL: &str = "switchyard_settled_tokens_total";
/// Gauge: unix time of a node's last heartbeat on the replica holding its socket, by `node`.
pub const NODE_LAST_HEARTBEAT_TIMESTAMP_SECONDS: &str =
    "switchyard_node_last_heartbeat_timestamp_seconds";
/// Counter: reports of a node that could not be true and were clamped or left out of the cost
/// and drift reports, by `kind`: `gpus` (a registration with more than
/// `MAX_GPUS_PER_NODE` GPUs), `prompt_counter`, `generation_counter` (an engine counter step
/// faster than `MAX_ENGINE_TOKENS_PER_SECOND`).
pub const NODE_REPORT_ANOMALIES_TOTAL: &str = "switchyard_node_report_anomalies_total";

/// Counter: nodes the replica holding their socket dropped without their having drained (the
/// socket closed or failed, or heartbeats stopped), by `node`. A node that said `draining` (its
/// agent's SIGTERM) or was drained by an operator and then left is not counted, nor is one
/// disconnected for protocol violations ([`NODE_PROTOCOL_VIOLATIONS_TOTAL`]). Each node's
/// series starts at 0 when it registers, so `increase()` sees its first loss.
pub const NODES_LOST_TOTAL: &str = "switchyard_nodes_lost_total";

/// Exports at 0 the series of counters that otherwise appear only with their first event, so
/// that `increase()` and `rate()` see that event (a series born at 1 shows no increase): actor
/// restarts for every kind, losses of the coordinator's data, fenced queue messages for each served model, and the refusals
/// admission answers while its database, Redis or JWKS is unreachable. Only known label values,
/// so the cardinality stays bounded. Call it once the recorder is installed.
pub fn zero_known_series<'a>(models: impl IntoIterator<Item = &'a str>) {
    for kind in crate::supervision::kind::ALL {
        metrics::counter!(ACTOR_RESTARTS_TOTAL, "kind" => kind).increment(0);
    }
    metrics::counter!(COORDINATOR_DATA_LOST_TOTAL).increment(0);
    for model in models {
        metrics::counter!(QUEUE_FENCED_TOTAL, "model" => model.to_owned()).increment(0);
        metrics::counter!(QUEUE_SLOTS_RECLAIMED_TOTAL, "model" => model.to_owned()).increment(0);
    }
    let code = crate::error::ErrorCode::QuotaServiceUnavailable.as_str();
    metrics::counter!(REQUESTS_TOTAL, "model" => "", "code" => code).increment(0);
}

/// Adds what one settle billed to [`SETTLED_TOKENS_TOTAL`].
pub(crate) fn count_settled_tokens(model: String, prompt: u64, completion: u64) {
    metrics::counter!(SETTLED_TOKENS_TOTAL, "model" => model.clone(), "kind" => "prompt")
        .increment(prompt);
    metrics::counter!(SETTLED_TOKENS_TOTAL, "model" => model, "kind" => "completion")
        .increment(completion);
}
