//! The event journal of a resumable generation on Redis: a stream per generation whose ids
//! are `0-<number + 1>`, appended by one script (XADD, PEXPIRE, PUBLISH on a wake-up
//! channel) and read with XRANGE; a caught-up reader subscribes and looks again.

use std::time::Duration;

use switchyard_actors::ports::{CoordError, Coordinator};

use super::scripts::APPEND_EVENTS;
use super::{RedisCoordinator, ttl_millis};

impl RedisCoordinator {
    /// The journal's wake-up channel, as [`Coordinator::subscribe`] names it.
    fn journal_channel(key: &str) -> String {
        format!("journal:{key}")
    }

    /// Up to `max` journal events after `after`, without waiting: one XRANGE.
    async fn journal_after(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
        // Ids are `0-<number + 1>`, so "after n" starts at `0-<n + 2>` inclusive.
        let start = after.map_or(1, |a| a.saturating_add(2));
        let (generation, mut conn) = self.commands();
        let reply: redis::Value = self
            .bounded(
                "read_events",
                generation,
                redis::cmd("XRANGE")
                    .arg(self.key(key))
                    .arg(format!("0-{start}"))
                    .arg("+")
                    .arg("COUNT")
                    .arg(max.max(1))
                    .query_async(&mut conn),
            )
            .await?;
        parse_journal(reply)
    }

    /// Appends `events` numbered from `first_seq` (numbers already there are skipped), sets
    /// the TTL and wakes waiting readers: one script call.
    pub(super) async fn journal_append(
        &self,
        key: &str,
        first_seq: u64,
        events: Vec<Vec<u8>>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        if events.is_empty() {
            return Ok(());
        }
        let mut invocation = APPEND_EVENTS.prepare_invoke();
        invocation
            .key(self.key(key))
            .arg(ttl_millis(ttl))
            .arg(self.channel(&Self::journal_channel(key)))
            .arg(first_seq);
        for event in events {
            invocation.arg(event);
        }
        let (generation, mut conn) = self.commands();
        self.bounded(
            "append_events",
            generation,
            invocation.invoke_async::<redis::Value>(&mut conn),
        )
        .await?;
        Ok(())
    }

    /// Up to `max` events after `after`; when caught up, waits up to `block` for the next
    /// append.
    pub(super) async fn journal_read(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
        block: Duration,
    ) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
        let found = self.journal_after(key, after, max).await?;
        if !found.is_empty() || block.is_zero() {
            return Ok(found);
        }
        // Caught up: listen for the next append, then look again (an append between the
        // first look and the subscription would otherwise be waited for in vain).
        let mut woken = self.subscribe(&Self::journal_channel(key)).await?;
        let found = self.journal_after(key, after, max).await?;
        if !found.is_empty() {
            return Ok(found);
        }
        let _ = tokio::time::timeout(block, woken.recv()).await;
        self.journal_after(key, after, max).await
    }
}

/// Reads an XRANGE reply of a journal: `[[id, [field, event]], …]` with ids `0-<n + 1>`.
fn parse_journal(reply: redis::Value) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
    use redis::Value as V;
    let bad = || CoordError::Unavailable("redis read_events: malformed journal entry".to_owned());
    let entries = match reply {
        V::Array(entries) => entries,
        V::Nil => return Ok(Vec::new()),
        _ => return Err(bad()),
    };
    let mut out = Vec::with_capacity(entries.len());
    for entry in entries {
        let V::Array(mut parts) = entry else {
            return Err(bad());
        };
        if parts.len() != 2 {
            return Err(bad());
        }
        let fields = parts.pop().ok_or_else(bad)?;
        let id = parts.pop().ok_or_else(bad)?;
        let id: String = redis::from_redis_value(id).map_err(|_| bad())?;
        let number = id
            .strip_prefix("0-")
            .and_then(|n| n.parse::<u64>().ok())
            .and_then(|n| n.checked_sub(1))
            .ok_or_else(bad)?;
        let V::Array(mut fields) = fields else {
            return Err(bad());
        };
        let event = fields.pop().ok_or_else(bad)?;
        let event: Vec<u8> = redis::from_redis_value(event).map_err(|_| bad())?;
        out.push((number, event));
    }
    Ok(out)
}
