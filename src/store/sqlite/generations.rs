//! [`GenerationStore`] on SQLite. Every change runs in one `BEGIN IMMEDIATE` transaction
//! (this store's writer turn, then SQLite's write lock), so the reads that feed
//! [`decide`] and [`apply`] and the writes of their results see no rival writer: the write
//! lock is the principal's lock here, and every record's too.

use async_trait::async_trait;

use switchyard_actors::lifecycle::admission::decide;
use switchyard_actors::lifecycle::{
    Applied, Decision, Event, GenerationRecord, GenerationStore, LifecycleError, MessagePolicy,
    NewGeneration, WindowCounters, apply, window_start,
};

use super::SqliteStore;
use crate::store::sql::{
    COUNT_HELD_SLOTS, DROP_OUTPUTS, INSERT_GENERATION, RESERVE_MESSAGE, RecordParams,
    SELECT_BUCKET, SELECT_EXPIRED, SELECT_GENERATION, SELECT_GENERATION_BY_KEY, SELECT_WINDOW,
    SETTLE_MESSAGE, STORE_BUCKET, SWEEP_PAGE, UPDATE_GENERATION, active_count, bind_record, bucket,
    effect_params, expire_pages, generation_from_row, lifecycle_unavailable as unavailable,
    window_counters,
};

#[async_trait]
impl GenerationStore for SqliteStore {
    async fn admit_generation(
        &self,
        new: &NewGeneration,
        policy: &MessagePolicy,
        now_ms: i64,
    ) -> Result<Decision, LifecycleError> {
        let mut w = self.begin_write().await.map_err(unavailable)?;
        let existing = sqlx::query(SELECT_GENERATION_BY_KEY)
            .bind(&new.subject)
            .bind(&new.idempotency_key)
            .fetch_optional(&mut *w.tx)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(generation_from_row)
            .transpose()?;
        let held: i64 = sqlx::query_scalar(COUNT_HELD_SLOTS)
            .bind(&new.subject)
            .bind(now_ms)
            .fetch_one(&mut *w.tx)
            .await
            .map_err(unavailable)?;
        let window: Option<(i64, i64)> = sqlx::query_as(SELECT_WINDOW)
            .bind(&new.subject)
            .bind(window_start(now_ms, policy.window_ms))
            .fetch_optional(&mut *w.tx)
            .await
            .map_err(unavailable)?;
        let stored_bucket: Option<(Option<i64>, Option<i64>)> = sqlx::query_as(SELECT_BUCKET)
            .bind(&new.subject)
            .fetch_optional(&mut *w.tx)
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
            // Nothing was written; dropping `w` rolls back and passes the turn on.
            Err(decision) => return Ok(decision),
        };
        let params = RecordParams::of(&admit.record)?;
        let write = if admit.readmit {
            UPDATE_GENERATION
        } else {
            INSERT_GENERATION
        };
        bind_record!(sqlx::query(write), params, std::convert::identity)
            .execute(&mut *w.tx)
            .await
            .map_err(unavailable)?;
        sqlx::query(RESERVE_MESSAGE)
            .bind(&new.subject)
            .bind(admit.window_start_ms)
            .execute(&mut *w.tx)
            .await
            .map_err(unavailable)?;
        sqlx::query(STORE_BUCKET)
            .bind(&new.subject)
            .bind(admit.bucket.milli)
            .bind(admit.bucket.at_ms)
            .execute(&mut *w.tx)
            .await
            .map_err(unavailable)?;
        w.tx.commit().await.map_err(unavailable)?;
        Ok(Decision::Admitted(admit.record))
    }

    async fn find_generation(
        &self,
        subject: &str,
        idempotency_key: &str,
    ) -> Result<Option<GenerationRecord>, LifecycleError> {
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
        let mut w = self.begin_write().await.map_err(unavailable)?;
        let mut record = sqlx::query(SELECT_GENERATION)
            .bind(id)
            .fetch_optional(&mut *w.tx)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(generation_from_row)
            .transpose()?
            .ok_or(LifecycleError::Unknown)?;
        let result = apply(&mut record, event, now_ms);
        let Ok(effects) = &result else {
            // Refused: the record is unchanged and nothing is written.
            return Ok(Applied { record, result });
        };
        let params = RecordParams::of(&record)?;
        bind_record!(
            sqlx::query(UPDATE_GENERATION),
            params,
            std::convert::identity
        )
        .execute(&mut *w.tx)
        .await
        .map_err(unavailable)?;
        for effect in effects {
            let (window_start_ms, used) = effect_params(*effect);
            sqlx::query(SETTLE_MESSAGE)
                .bind(&record.subject)
                .bind(window_start_ms)
                .bind(used)
                .execute(&mut *w.tx)
                .await
                .map_err(unavailable)?;
        }
        w.tx.commit().await.map_err(unavailable)?;
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
        let _turn = self.writer.lock().await;
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
        let row: Option<(i64, i64)> = sqlx::query_as(SELECT_WINDOW)
            .bind(subject)
            .bind(window_start_ms)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        window_counters(row)
    }
}
