//! Helpers both SQL stores share: how database failures and counts map onto the store's,
//! the ledger's and the generation store's errors, and the generation statements and row
//! mapping, so the two backends run the same text.

use std::collections::{BTreeMap, BTreeSet};

use sqlx::{ColumnIndex, Decode, Row, Type};
use switchyard_actors::lifecycle::{
    AttemptState, Bucket, Effect, Event, GenerationRecord, GenerationStore, LifecycleError,
    MessageState, Status, WindowCounters,
};
use switchyard_actors::ports::{
    LedgerError, MAX_TOKEN_COUNT, Microcredits, Reservation, ReviewReason, Settlement, UsageBounds,
    cost_of,
};

/// Columns of `usage_ledger` read into a [`LedgerRow`](super::LedgerRow), the same on both
/// backends.
macro_rules! ledger_columns {
    () => {
        "id, request_id, team_id, key_id, model, prompt_tokens, completion_tokens, \
         cost_microcredits, estimated_cost_microcredits, price_input_per_mtok, \
         price_output_per_mtok, status, created_at, settled_at, prompt_token_bound, \
         completion_token_bound, claimed_prompt_tokens, claimed_completion_tokens, review"
    };
}
pub(crate) use ledger_columns;

/// A row's bound on one count, unbounded (the ledger's range) for rows admitted before
/// bounds existed.
macro_rules! bound_sql {
    ($column:literal) => {
        concat!("COALESCE(", $column, ", 9223372036854775807)")
    };
}
pub(crate) use bound_sql;

/// Whether a settle's claim (`$2` prompt, `$3` completion, saturated; `$4` when either was
/// beyond i64 before saturating) exceeds the row's bounds: [`UsageBounds::bill`]'s `clamped`.
/// Both backends read `$n` placeholders.
///
/// [`UsageBounds::bill`]: switchyard_actors::ports::UsageBounds::bill
macro_rules! clamped {
    () => {
        concat!(
            "($4 OR $2 > ",
            $crate::store::sql::bound_sql!("prompt_token_bound"),
            " OR $3 > ",
            $crate::store::sql::bound_sql!("completion_token_bound"),
            ")"
        )
    };
}
pub(crate) use clamped;

use super::StoreError;

pub(super) fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

pub(super) fn ledger_unavailable(e: sqlx::Error) -> LedgerError {
    LedgerError::Unavailable(e.to_string())
}

pub(super) fn found(rows_affected: u64) -> Result<(), StoreError> {
    if rows_affected == 0 {
        Err(StoreError::NotFound)
    } else {
        Ok(())
    }
}

/// A count as the signed 64-bit column both databases have, saturated at `i64::MAX`. Claims
/// (a node's report) and bounds may be any u64; the ledger bills no more than a row's bound,
/// which is at most `i64::MAX`, so saturating a claim never changes what is billed, and a
/// count too large to store can never fail a settle or leave its row reserved.
pub(super) fn saturated(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A row's bound as stored, as the port's: NULL (a row admitted before bounds existed) and a
/// negative value (refused by the schema) read as no bound.
fn bound(stored: Option<i64>) -> u64 {
    stored
        .and_then(|b| u64::try_from(b).ok())
        .unwrap_or(MAX_TOKEN_COUNT)
}

/// A row's bounds as stored.
pub(super) fn stored_bounds(prompt: Option<i64>, completion: Option<i64>) -> UsageBounds {
    UsageBounds {
        prompt_tokens: bound(prompt),
        completion_tokens: bound(completion),
    }
}

/// What a settle statement wrote, as it returned it.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Settled {
    pub(super) prompt_tokens: i64,
    pub(super) completion_tokens: i64,
    pub(super) claimed: Option<(i64, i64)>,
    pub(super) review: Option<String>,
    pub(super) cost: i64,
}

impl Settled {
    /// What the port's rule says a settle of `s` writes into a row with these bounds and
    /// prices: [`UsageBounds::bill`], the claim kept when clamped (saturated, as stored),
    /// the settlement's review or else `usage_over_bound` when clamped, and [`cost_of`] of
    /// the bill.
    pub(super) fn expected(
        s: &Settlement,
        bounds: UsageBounds,
        price_input_per_mtok: i64,
        price_output_per_mtok: i64,
    ) -> Self {
        let billed = bounds.bill(s.prompt_tokens, s.completion_tokens);
        Self {
            prompt_tokens: saturated(billed.prompt_tokens),
            completion_tokens: saturated(billed.completion_tokens),
            claimed: billed
                .clamped
                .then(|| (saturated(s.prompt_tokens), saturated(s.completion_tokens))),
            review: s
                .review
                .or(billed.clamped.then_some(ReviewReason::UsageOverBound))
                .map(|r| r.as_str().to_owned()),
            cost: cost_of(
                billed.prompt_tokens,
                billed.completion_tokens,
                price_input_per_mtok,
                price_output_per_mtok,
            ),
        }
    }

    /// Fails unless the statement wrote exactly `expected`. Cannot happen unless the SQL
    /// and the port's rule drift apart; a wrong bill must never commit, so the caller
    /// returns the error, which rolls the settle back and leaves it retryable.
    pub(super) fn check(self, expected: &Self, request_id: &str) -> Result<Self, LedgerError> {
        if self == *expected {
            Ok(self)
        } else {
            Err(LedgerError::Unavailable(format!(
                "settle of {request_id:?} wrote {self:?} in SQL but the rule says {expected:?}"
            )))
        }
    }
}

// ---------------------------------------------------------------------------------------
// Batched reservations ([`Ledger::reserve_batch`]): one rule for both backends, decided in
// order against running totals, exactly as the single-row `reserve` decides each row.
//
// [`Ledger::reserve_batch`]: switchyard_actors::ports::Ledger::reserve_batch

/// A team as a batch sees it under the team's lock.
#[derive(Debug, Clone, Copy)]
pub(super) struct TeamRoom {
    /// Its balance.
    pub(super) balance: Microcredits,
    /// What its open reservations hold, including the ones this batch accepted so far.
    pub(super) held: Microcredits,
}

/// How a batch's rows were decided before any is written.
#[derive(Debug)]
pub(super) struct BatchPlan {
    /// One answer per reservation, in order; `Ok` means "to insert".
    pub(super) results: Vec<Result<(), LedgerError>>,
    /// Positions of the accepted reservations, in order.
    pub(super) accepted: Vec<usize>,
}

/// Decides each reservation of `batch` in order, as `reserve` would one after the other:
/// a row `refuse` rejects up front (text the backend cannot store) and a row of an unknown
/// team are `Unavailable`, an id taken before the batch (`taken`) or earlier in it is
/// `Duplicate`, an estimate the team's room cannot cover is `InsufficientBalance` (a later,
/// smaller one may still fit), and the rest are accepted and held against their team.
pub(super) fn plan_batch(
    batch: &[Reservation],
    teams: &mut BTreeMap<i64, TeamRoom>,
    taken: &BTreeSet<String>,
    refuse: impl Fn(&Reservation) -> Option<LedgerError>,
) -> BatchPlan {
    let mut seen = BTreeSet::new();
    let mut plan = BatchPlan {
        results: Vec::with_capacity(batch.len()),
        accepted: Vec::new(),
    };
    for (i, r) in batch.iter().enumerate() {
        let result = if let Some(e) = refuse(r) {
            Err(e)
        } else if let Some(room) = teams.get_mut(&r.team_id) {
            // A retried reservation is a duplicate even when its own estimate fills the
            // balance; a duplicate inside the batch loses to its first occurrence.
            if taken.contains(&r.request_id) || !seen.insert(r.request_id.as_str()) {
                Err(LedgerError::Duplicate)
            } else if !super::covers(room.balance, room.held, r.estimated_cost) {
                Err(LedgerError::InsufficientBalance)
            } else {
                room.held = room.held.saturating_add(r.estimated_cost);
                plan.accepted.push(i);
                Ok(())
            }
        } else {
            Err(LedgerError::Unavailable(format!("no team {}", r.team_id)))
        };
        plan.results.push(result);
    }
    plan
}

/// Every team's room after a batch: balance minus open reservations.
pub(super) fn available(teams: &BTreeMap<i64, TeamRoom>) -> BTreeMap<i64, Microcredits> {
    teams
        .iter()
        .map(|(&id, room)| (id, room.balance.saturating_sub(room.held)))
        .collect()
}

/// A batch whose transaction failed: every row it would have inserted is `Unavailable`
/// (nothing was written), the refusals decided before stand.
pub(super) fn batch_failed(mut plan: BatchPlan, e: &LedgerError) -> Vec<Result<(), LedgerError>> {
    for &i in &plan.accepted {
        if let Some(slot) = plan.results.get_mut(i) {
            *slot = Err(e.clone());
        }
    }
    plan.results
}

// ---------------------------------------------------------------------------------------
// Generations (the [`GenerationStore`] port): the statements and row mapping both backends
// run, so they cannot drift apart. SQLite understands PostgreSQL's `$n` placeholders (sqlx
// binds them by number), so one text serves both.

/// Columns of `generations` read into a [`GenerationRecord`], in the order
/// [`bind_record!`] binds them.
macro_rules! generation_columns {
    () => {
        "id, subject, idempotency_key, fingerprint, model, status, cancel_requested, attempt, \
         attempt_state, message, window_start_ms, slot_held, slot_expires_ms, input_tokens, \
         output_tokens, output, error_code, created_ms, terminal_ms, ledger_id, finish_reason, \
         output_extra"
    };
}

/// The record with this id.
pub(super) const SELECT_GENERATION: &str = concat!(
    "SELECT ",
    generation_columns!(),
    " FROM generations WHERE id = $1"
);

/// The record of (subject, idempotency key).
pub(super) const SELECT_GENERATION_BY_KEY: &str = concat!(
    "SELECT ",
    generation_columns!(),
    " FROM generations WHERE subject = $1 AND idempotency_key = $2"
);

/// [`SELECT_GENERATION`], locking the row (PostgreSQL; SQLite's write lock covers it).
pub(super) const LOCK_GENERATION: &str = concat!(
    "SELECT ",
    generation_columns!(),
    " FROM generations WHERE id = $1 FOR UPDATE"
);

/// [`SELECT_GENERATION_BY_KEY`], locking the row (PostgreSQL).
pub(super) const LOCK_GENERATION_BY_KEY: &str = concat!(
    "SELECT ",
    generation_columns!(),
    " FROM generations WHERE subject = $1 AND idempotency_key = $2 FOR UPDATE"
);

/// A new record; bind with [`bind_record!`].
pub(super) const INSERT_GENERATION: &str = concat!(
    "INSERT INTO generations (",
    generation_columns!(),
    ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, \
     $18, $19, $20, $21, $22)"
);

/// Overwrites record `$1` with everything [`apply`](switchyard_actors::lifecycle::apply)
/// or a readmission may change; bind with [`bind_record!`] (subject and key are bound too,
/// and never change).
pub(super) const UPDATE_GENERATION: &str = "UPDATE generations SET fingerprint = $4, \
     model = $5, status = $6, cancel_requested = $7, attempt = $8, attempt_state = $9, \
     message = $10, window_start_ms = $11, slot_held = $12, slot_expires_ms = $13, \
     input_tokens = $14, output_tokens = $15, output = $16, error_code = $17, \
     created_ms = $18, terminal_ms = $19, ledger_id = $20, finish_reason = $21, \
     output_extra = $22 \
     WHERE id = $1 AND subject = $2 \
     AND idempotency_key = $3";

/// Slots a principal holds at `$2`: held and not past their bound (an expired slot no
/// longer counts, even before the sweeper ends its generation).
pub(super) const COUNT_HELD_SLOTS: &str = "SELECT COUNT(*) FROM generations \
     WHERE subject = $1 AND slot_held AND slot_expires_ms > $2";

/// A principal's counters in one window.
pub(super) const SELECT_WINDOW: &str =
    "SELECT used, reserved FROM message_windows WHERE subject = $1 AND window_start_ms = $2";

/// Admission's reservation: `reserved + 1` in the window.
pub(super) const RESERVE_MESSAGE: &str = "INSERT INTO message_windows \
     (subject, window_start_ms, used, reserved) VALUES ($1, $2, 0, 1) \
     ON CONFLICT (subject, window_start_ms) \
     DO UPDATE SET reserved = message_windows.reserved + 1";

/// An [`Effect`]: `reserved - 1`, and `used + $3` (1 to consume, 0 to release). `reserved`
/// stops at zero as in the in-memory reference, so a counter that drifted can never wedge a
/// generation's transitions on the CHECK.
pub(super) const SETTLE_MESSAGE: &str = "INSERT INTO message_windows \
     (subject, window_start_ms, used, reserved) VALUES ($1, $2, $3, 0) \
     ON CONFLICT (subject, window_start_ms) \
     DO UPDATE SET used = message_windows.used + excluded.used, \
     reserved = CASE WHEN message_windows.reserved > 0 \
     THEN message_windows.reserved - 1 ELSE 0 END";

/// A principal's bucket.
pub(super) const SELECT_BUCKET: &str =
    "SELECT bucket_milli, bucket_at_ms FROM generation_principals WHERE subject = $1";

/// Stores a principal's bucket after an admission took a token.
pub(super) const STORE_BUCKET: &str = "INSERT INTO generation_principals \
     (subject, bucket_milli, bucket_at_ms) VALUES ($1, $2, $3) \
     ON CONFLICT (subject) DO UPDATE SET bucket_milli = excluded.bucket_milli, \
     bucket_at_ms = excluded.bucket_at_ms";

/// One page of the sweeper's work: active generations past their bound at `$1`, by id after
/// `$2`, at most `$3`.
pub(super) const SELECT_EXPIRED: &str = "SELECT id FROM generations \
     WHERE status IN ('queued', 'running') AND slot_expires_ms <= $1 AND id > $2 \
     ORDER BY id LIMIT $3";

/// Forgets outputs of generations that ended at or before `$1`.
pub(super) const DROP_OUTPUTS: &str = "UPDATE generations SET output = NULL, output_extra = NULL \
     WHERE output IS NOT NULL AND terminal_ms <= $1";

/// Generations expired per sweeper page.
pub(super) const SWEEP_PAGE: i64 = 256;

/// Expires every active generation past its slot's bound, a page of ids at a time: `page`
/// lists the ids after the given one (`SELECT_EXPIRED`), and each expiry is its own
/// [`Event::Expire`] transition, which re-reads the record under its lock, so one that ended
/// since its page was read is refused and left alone. Returns how many expired.
pub(super) async fn expire_pages<S, F, Fut>(
    store: &S,
    now_ms: i64,
    mut page: F,
) -> Result<u64, LifecycleError>
where
    S: GenerationStore + ?Sized,
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<String>, LifecycleError>>,
{
    let mut expired = 0;
    let mut after = String::new();
    loop {
        let ids = page(after.clone()).await?;
        for id in &ids {
            match store.apply_generation(id, &Event::Expire, now_ms).await {
                Ok(applied) if applied.result.is_ok() => expired += 1,
                Ok(_) | Err(LifecycleError::Unknown) => {}
                Err(e) => return Err(e),
            }
        }
        match ids.last() {
            Some(last) if i64::try_from(ids.len()).unwrap_or(i64::MAX) >= SWEEP_PAGE => {
                after.clone_from(last);
            }
            _ => return Ok(expired),
        }
    }
}

pub(super) fn lifecycle_unavailable(e: sqlx::Error) -> LifecycleError {
    LifecycleError::Unavailable(e.to_string())
}

/// A u64 of the record as the signed 64-bit column both databases have; a value beyond it
/// is refused (the transaction rolls back) rather than clamped. The message names the
/// field, never its value.
fn column_i64(n: u64, name: &str) -> Result<i64, LifecycleError> {
    i64::try_from(n).map_err(|_| LifecycleError::Unavailable(format!("{name} out of range")))
}

/// A [`GenerationRecord`] as bind values, in [`generation_columns!`] order.
pub(super) struct RecordParams<'a> {
    pub(super) rec: &'a GenerationRecord,
    pub(super) attempt: i64,
    pub(super) input_tokens: i64,
    pub(super) output_tokens: i64,
}

impl<'a> RecordParams<'a> {
    pub(super) fn of(rec: &'a GenerationRecord) -> Result<Self, LifecycleError> {
        Ok(Self {
            rec,
            attempt: column_i64(rec.attempt, "attempt")?,
            input_tokens: column_i64(rec.input_tokens, "input_tokens")?,
            output_tokens: column_i64(rec.output_tokens, "output_tokens")?,
        })
    }
}

/// Binds a [`RecordParams`] to [`INSERT_GENERATION`] or [`UPDATE_GENERATION`]; `$output`
/// turns the output text into the backend's column value (the text itself on SQLite, its
/// UTF-8 bytes on PostgreSQL: see [`OutputColumn`]). A macro rather than a function: it works
/// on either backend's query without spelling out sqlx's encoding bounds.
macro_rules! bind_record {
    ($query:expr, $p:expr, $output:expr) => {{
        let p = &$p;
        $query
            .bind(p.rec.id.as_str())
            .bind(p.rec.subject.as_str())
            .bind(p.rec.idempotency_key.as_str())
            .bind(p.rec.fingerprint.as_str())
            .bind(p.rec.model.as_str())
            .bind(p.rec.status.as_str())
            .bind(p.rec.cancel_requested)
            .bind(p.attempt)
            .bind(p.rec.attempt_state.as_str())
            .bind(p.rec.message.as_str())
            .bind(p.rec.window_start_ms)
            .bind(p.rec.slot_held)
            .bind(p.rec.slot_expires_ms)
            .bind(p.input_tokens)
            .bind(p.output_tokens)
            .bind(($output)(p.rec.output.as_deref()))
            .bind(p.rec.error_code.as_deref())
            .bind(p.rec.created_ms)
            .bind(p.rec.terminal_ms)
            .bind(p.rec.ledger_id.as_str())
            .bind(p.rec.finish_reason.as_deref())
            .bind(p.rec.output_extra.as_deref())
    }};
}
pub(super) use bind_record;

/// The window and the `used` increment an [`Effect`] names, for [`SETTLE_MESSAGE`].
pub(super) fn effect_params(effect: Effect) -> (i64, i64) {
    match effect {
        Effect::ConsumeMessage { window_start_ms } => (window_start_ms, 1),
        Effect::ReleaseMessage { window_start_ms } => (window_start_ms, 0),
    }
}

/// Reads a column; a decode failure names the column, never the value.
fn gen_col<'r, R, T>(row: &'r R, name: &str) -> Result<T, LifecycleError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    T: Decode<'r, R::Database> + Type<R::Database>,
{
    row.try_get(name)
        .map_err(|_| LifecycleError::Unavailable(format!("generations.{name} is unreadable")))
}

fn gen_u64<R>(row: &R, name: &str) -> Result<u64, LifecycleError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let v: i64 = gen_col(row, name)?;
    u64::try_from(v).map_err(|_| LifecycleError::Unavailable(format!("generations.{name} < 0")))
}

fn gen_enum<R, T>(row: &R, name: &str, parse: fn(&str) -> Option<T>) -> Result<T, LifecycleError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    let text: String = gen_col(row, name)?;
    parse(&text)
        .ok_or_else(|| LifecycleError::Unavailable(format!("generations.{name} is unknown")))
}

/// How a backend stores a generation's output. A node's output is any text, NUL included;
/// PostgreSQL's TEXT cannot hold NUL, so there the column is BYTEA holding the UTF-8 (see
/// `migrations/postgres/0003_usage_bounds.sql`), while SQLite's TEXT holds it as it is.
pub(super) trait OutputColumn {
    /// The `output` column as text; bytes that are not UTF-8 are an unreadable row.
    fn output(&self) -> Result<Option<String>, LifecycleError>;
}

impl OutputColumn for sqlx::sqlite::SqliteRow {
    fn output(&self) -> Result<Option<String>, LifecycleError> {
        gen_col(self, "output")
    }
}

impl OutputColumn for sqlx::postgres::PgRow {
    fn output(&self) -> Result<Option<String>, LifecycleError> {
        gen_col::<_, Option<Vec<u8>>>(self, "output")?
            .map(|bytes| {
                String::from_utf8(bytes).map_err(|_| {
                    LifecycleError::Unavailable("generations.output is not UTF-8".to_owned())
                })
            })
            .transpose()
    }
}

/// A `generations` row (all of [`generation_columns!`]) as a record, on either backend.
pub(super) fn generation_from_row<R>(row: &R) -> Result<GenerationRecord, LifecycleError>
where
    R: Row + OutputColumn,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(GenerationRecord {
        id: gen_col(row, "id")?,
        subject: gen_col(row, "subject")?,
        idempotency_key: gen_col(row, "idempotency_key")?,
        fingerprint: gen_col(row, "fingerprint")?,
        model: gen_col(row, "model")?,
        status: gen_enum(row, "status", Status::parse)?,
        cancel_requested: gen_col(row, "cancel_requested")?,
        attempt: gen_u64(row, "attempt")?,
        attempt_state: gen_enum(row, "attempt_state", AttemptState::parse)?,
        message: gen_enum(row, "message", MessageState::parse)?,
        window_start_ms: gen_col(row, "window_start_ms")?,
        slot_held: gen_col(row, "slot_held")?,
        slot_expires_ms: gen_col(row, "slot_expires_ms")?,
        input_tokens: gen_u64(row, "input_tokens")?,
        output_tokens: gen_u64(row, "output_tokens")?,
        output: row.output()?,
        error_code: gen_col(row, "error_code")?,
        created_ms: gen_col(row, "created_ms")?,
        terminal_ms: gen_col(row, "terminal_ms")?,
        ledger_id: gen_col(row, "ledger_id")?,
        finish_reason: gen_col(row, "finish_reason")?,
        output_extra: gen_col(row, "output_extra")?,
    })
}

/// `(used, reserved)` as stored, as [`WindowCounters`]; a missing row is an untouched window.
pub(super) fn window_counters(row: Option<(i64, i64)>) -> Result<WindowCounters, LifecycleError> {
    let Some((used, reserved)) = row else {
        return Ok(WindowCounters::default());
    };
    let counter = |v: i64, name: &str| {
        u32::try_from(v).map_err(|_| {
            LifecycleError::Unavailable(format!("message_windows.{name} out of range"))
        })
    };
    Ok(WindowCounters {
        used: counter(used, "used")?,
        reserved: counter(reserved, "reserved")?,
    })
}

/// A principal's stored bucket; `None` before its first admission (it starts full).
pub(super) fn bucket(row: Option<(Option<i64>, Option<i64>)>) -> Option<Bucket> {
    match row {
        Some((Some(milli), Some(at_ms))) => Some(Bucket { milli, at_ms }),
        _ => None,
    }
}

/// Held slots as [`decide`](switchyard_actors::lifecycle::admission::decide) takes them.
pub(super) fn active_count(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}
