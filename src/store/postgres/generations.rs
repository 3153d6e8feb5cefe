//! [`GenerationStore`] on PostgreSQL, shared by every replica. Row locks stand in for the
//! in-memory reference's mutex:
//!
//! * an admission locks its principal's `generation_principals` row (`FOR UPDATE`, inserted
//!   first if missing), so a principal's admissions run one at a time across replicas and
//!   each one's reads (the key's record, held slots, the window, the bucket) come after the
//!   previous holder committed;
//! * a transition locks its `generations` row, so concurrent events on one record apply one
//!   after the other, each to what the previous one wrote.
//!
//! Transitions need not take the principal's lock: [`apply`] never adds to what admission
//! counts (a consume moves a message from `reserved` to `used`, a release and an ended slot
//! take away), so an admission that overlaps one can only be stricter than needed, and the
//! window counters change by in-place `UPDATE`s that never lose a concurrent increment.
//! Locks are always taken principal, then record, then window, so no two transactions wait
//! on each other in a cycle. Transactions run at READ COMMITTED (see the parent module): a
//! statement issued after a lock wait sees what the holder committed.

use async_trait::async_trait;

use switchyard_actors::lifecycle::admission::decide;
use switchyard_actors::lifecycle::{
    Applied, Decision, Event, GenerationRecord, GenerationStore, LifecycleError, MessagePolicy,
    NewGeneration, WindowCounters, apply, window_start,
};

use super::PostgresStore;
use super::rows::storable;
use crate::store::sql::{
    COUNT_HELD_SLOTS, DROP_OUTPUTS, INSERT_GENERATION, LOCK_GENERATION, LOCK_GENERATION_BY_KEY,
    RESERVE_MESSAGE, RecordParams, SELECT_EXPIRED, SELECT_GENERATION, SELECT_GENERATION_BY_KEY,
    SELECT_WINDOW, SETTLE_MESSAGE, STORE_BUCKET, SWEEP_PAGE, UPDATE_GENERATION, active_count,
    bind_record, bucket, effect_params, expire_pages, generation_from_row,
    lifecycle_unavailable as unavailable, window_counters,
};

/// Creates the principal's lock row on its first admission; a concurrent first admission
/// waits on the unique index, then finds the row.
const ENSURE_PRINCIPAL: &str =
    "INSERT INTO generation_principals (subject) VALUES ($1) ON CONFLICT (subject) DO NOTHING";
/// Takes the principal's lock and reads its bucket.
const LOCK_PRINCIPAL: &str = "SELECT bucket_milli, bucket_at_ms FROM generation_principals \
     WHERE subject = $1 FOR UPDATE";

/// The output as its column holds it: the UTF-8 bytes (BYTEA, which keeps NUL; TEXT cannot).
fn output_bytes(output: Option<&str>) -> Option<&[u8]> {
    output.map(str::as_bytes)
}

#[async_trait]
impl GenerationStore for PostgresStore {
    async fn admit_generation(
        &self,
        new: &NewGeneration,
        policy: &MessagePolicy,
        now_ms: i64,
    ) -> Result<Decision, LifecycleError> {
        if ![
            &new.id,
            &new.subject,
            &new.idempotency_key,
            &new.fingerprint,
            &new.model,
        ]
        .iter()
        .all(|text| storable(text))
        {
            return Err(LifecycleError::Unavailable(
                "a generation's identity contains a NUL character".to_owned(),
            ));
        }
        let mut tx = self.begin().await.map_err(unavailable)?;
        sqlx::query(ENSURE_PRINCIPAL)
            .bind(&new.subject)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        let stored_bucket: Option<(Option<i64>, Option<i64>)> = sqlx::query_as(LOCK_PRINCIPAL)
            .bind(&new.subject)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?;
        // From here on, each statement's snapshot starts after the lock was granted. The
        // key's record is locked too, in case it is readmitted below.
        let existing = sqlx::query(LOCK_GENERATION_BY_KEY)
            .bind(&new.subject)
            .bind(&new.idempotency_key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(generation_from_row)
            .transpose()?;
        let held: i64 = sqlx::query_scalar(COUNT_HELD_SLOTS)
            .bind(&new.subject)
            .bind(now_ms)
            .fetch_one(&mut *tx)
            .await
            .map_err(unavailable)?;
        let window: Option<(i64, i64)> = sqlx::query_as(SELECT_WINDOW)
            .bind(&new.subject)
            .bind(window_start(now_ms, policy.window_ms))
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?;
        let admit = match decide(
            new,
            existing.as_ref(),
            policy,
            bucket(stored_bucket),
            active_count(held),
            window_counters(window)?,
            now_ms,
        ) {
            Ok(admit) => admit,
            // Nothing to keep: dropping `tx` rolls back (a first admission's lock row
            // included) and releases the lock.
            Err(decision) => return Ok(decision),
        };
        let params = RecordParams::of(&admit.record)?;
        let write = if admit.readmit {
            UPDATE_GENERATION
        } else {
            INSERT_GENERATION
        };
        bind_record!(sqlx::query(write), params, output_bytes)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        sqlx::query(RESERVE_MESSAGE)
            .bind(&new.subject)
            .bind(admit.window_start_ms)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        sqlx::query(STORE_BUCKET)
            .bind(&new.subject)
            .bind(admit.bucket.milli)
            .bind(admit.bucket.at_ms)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        Ok(Decision::Admitted(admit.record))
    }

    async fn find_generation(
        &self,
        subject: &str,
        idempotency_key: &str,
    ) -> Result<Option<GenerationRecord>, LifecycleError> {
        // Text with NUL cannot be stored, so no record has it.
        if !storable(subject) || !storable(idempotency_key) {
            return Ok(None);
        }
        sqlx::query(SELECT_GENERATION_BY_KEY)
            .bind(subject)
            .bind(idempotency_key)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(generation_from_row)
            .transpose()
    }

    async fn get_generation(&self, id: &str) -> Result<Option<GenerationRecord>, LifecycleError> {
        if !storable(id) {
            return Ok(None);
        }
        sqlx::query(SELECT_GENERATION)
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(generation_from_row)
            .transpose()
    }

    async fn apply_generation(
        &self,
        id: &str,
        event: &Event,
        now_ms: i64,
    ) -> Result<Applied, LifecycleError> {
        if !storable(id) {
            return Err(LifecycleError::Unknown);
        }
        let mut tx = self.begin().await.map_err(unavailable)?;
        let mut record = sqlx::query(LOCK_GENERATION)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(generation_from_row)
            .transpose()?
            .ok_or(LifecycleError::Unknown)?;
        let result = apply(&mut record, event, now_ms);
        let Ok(effects) = &result else {
            // Refused: the record is unchanged; dropping `tx` releases the row.
            return Ok(Applied { record, result });
        };
        let params = RecordParams::of(&record)?;
        bind_record!(sqlx::query(UPDATE_GENERATION), params, output_bytes)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        for effect in effects {
            let (window_start_ms, used) = effect_params(*effect);
            sqlx::query(SETTLE_MESSAGE)
                .bind(&record.subject)
                .bind(window_start_ms)
                .bind(used)
                .execute(&mut *tx)
                .await
                .map_err(unavailable)?;
        }
        tx.commit().await.map_err(unavailable)?;
        Ok(Applied { record, result })
    }

    async fn sweep_generations(
        &self,
        now_ms: i64,
        retention_ms: i64,
    ) -> Result<u64, LifecycleError> {
        let pool = &self.pool;
        let expired = expire_pages(self, now_ms, |after| async move {
            sqlx::query_scalar(SELECT_EXPIRED)
                .bind(now_ms)
                .bind(after)
                .bind(SWEEP_PAGE)
                .fetch_all(pool)
                .await
                .map_err(unavailable)
        })
        .await?;
        // One statement: its own transaction; each row it clears is already final.
        sqlx::query(DROP_OUTPUTS)
            .bind(now_ms.saturating_sub(retention_ms))
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(expired)
    }

    async fn message_window(
        &self,
        subject: &str,
        window_start_ms: i64,
    ) -> Result<WindowCounters, LifecycleError> {
        if !storable(subject) {
            return Ok(WindowCounters::default());
        }
        let row: Option<(i64, i64)> = sqlx::query_as(SELECT_WINDOW)
            .bind(subject)
            .bind(window_start_ms)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        window_counters(row)
    }
}
