//! An in-process [`Ledger`] with the same semantics as the SQL ones (unique request ids,
//! conditional final transitions, debits on settle). Used by the actors' tests and as the
//! reference the storage conformance suite is written against.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;

use super::{
    Ledger, LedgerError, Microcredits, Reservation, ReviewReason, SettleOutcome, Settlement,
    UsageBounds, cost_of,
};

/// The reservation the actors' tests admit with: team 1, key 1, 10 prompt tokens estimated
/// and at most 100 output tokens, at 1 and 2 microcredits per token, bounded by `bounds`.
pub fn reservation(request_id: &str, model: &str, bounds: UsageBounds) -> Reservation {
    Reservation {
        request_id: request_id.into(),
        team_id: 1,
        key_id: Some(1),
        model: model.into(),
        estimated_prompt_tokens: 10,
        max_tokens: 100,
        estimated_cost: 110,
        price_input_per_mtok: 1_000_000,
        price_output_per_mtok: 2_000_000,
        bounds,
    }
}

/// The state of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowStatus {
    /// Open: admitted, not final.
    Reserved,
    /// Final with usage.
    Settled,
    /// Final without usage.
    Cancelled,
}

/// One row of the in-memory ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryRow {
    /// The reservation it was opened with.
    pub reservation: Reservation,
    /// Where it is.
    pub status: RowStatus,
    /// Settled prompt tokens.
    pub prompt_tokens: u64,
    /// Settled completion tokens.
    pub completion_tokens: u64,
    /// Settled cost.
    pub cost: Microcredits,
    /// Why the row needs review, if it does.
    pub review: Option<ReviewReason>,
    /// The reported (prompt, completion) when it was clamped.
    pub claimed: Option<(u64, u64)>,
    /// How many settle or cancel calls changed it (1 once final).
    pub transitions: u32,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct MemoryLedger {
    rows: Mutex<BTreeMap<String, MemoryRow>>,
    /// Balances of the teams that have an account ([`MemoryLedger::credit`]); a team without
    /// one is never short (the actors' tests), one with one is held to it as the SQL ledgers
    /// hold a team: reserving needs the balance less open reservations, settling debits.
    balances: Mutex<BTreeMap<i64, Microcredits>>,
    /// Simulates an unreachable database.
    unavailable: Mutex<bool>,
}

impl MemoryLedger {
    /// A copy of a row.
    pub fn row(&self, request_id: &str) -> Option<MemoryRow> {
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(request_id)
            .cloned()
    }

    /// Rows still `reserved`.
    pub fn open(&self) -> usize {
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|r| r.status == RowStatus::Reserved)
            .count()
    }

    /// Adds `amount` to `team`'s balance, opening its account.
    pub fn credit(&self, team: i64, amount: Microcredits) {
        *self
            .balances
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(team)
            .or_default() += amount;
    }

    /// `team`'s balance, when it has an account.
    pub fn balance(&self, team: i64) -> Option<Microcredits> {
        self.balances
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&team)
            .copied()
    }

    /// What `team`'s settled rows cost in all.
    pub fn settled_cost(&self, team: i64) -> Microcredits {
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|r| r.status == RowStatus::Settled && r.reservation.team_id == team)
            .map(|r| r.cost)
            .sum()
    }

    /// A copy of every row.
    pub fn rows(&self) -> Vec<MemoryRow> {
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Makes every call fail with [`LedgerError::Unavailable`] (or work again).
    pub fn set_unavailable(&self, down: bool) {
        *self
            .unavailable
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = down;
    }

    fn check(&self) -> Result<(), LedgerError> {
        if *self
            .unavailable
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
        {
            return Err(LedgerError::Unavailable(
                "memory ledger switched off".into(),
            ));
        }
        Ok(())
    }

    fn finish(
        &self,
        request_id: &str,
        to: RowStatus,
        usage: Option<(u64, u64, Option<ReviewReason>)>,
    ) -> Result<SettleOutcome, LedgerError> {
        self.check()?;
        let mut rows = self.rows.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(row) = rows.get_mut(request_id) else {
            return Ok(SettleOutcome::Unknown);
        };
        if row.status != RowStatus::Reserved {
            return Ok(SettleOutcome::AlreadyFinal);
        }
        row.status = to;
        row.transitions += 1;
        if let Some((claimed_p, claimed_c, review)) = usage {
            let billed = row.reservation.bounds.bill(claimed_p, claimed_c);
            row.prompt_tokens = billed.prompt_tokens;
            row.completion_tokens = billed.completion_tokens;
            if billed.clamped {
                // As the SQL ledgers store it: a count beyond their integers reads as the
                // largest one.
                row.claimed = Some((
                    claimed_p.min(super::MAX_TOKEN_COUNT),
                    claimed_c.min(super::MAX_TOKEN_COUNT),
                ));
            }
            row.review = review.or(billed.clamped.then_some(ReviewReason::UsageOverBound));
            row.cost = cost_of(
                billed.prompt_tokens,
                billed.completion_tokens,
                row.reservation.price_input_per_mtok,
                row.reservation.price_output_per_mtok,
            );
            let team = row.reservation.team_id;
            if let Some(balance) = self
                .balances
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_mut(&team)
            {
                *balance = balance.saturating_sub(row.cost);
            }
        }
        Ok(SettleOutcome::Applied)
    }
}

#[async_trait]
impl Ledger for MemoryLedger {
    async fn reserve(&self, reservation: &Reservation) -> Result<(), LedgerError> {
        self.check()?;
        let mut rows = self.rows.lock().unwrap_or_else(PoisonError::into_inner);
        if rows.contains_key(&reservation.request_id) {
            return Err(LedgerError::Duplicate);
        }
        let team = reservation.team_id;
        if let Some(balance) = self.balance(team) {
            let held: Microcredits = rows
                .values()
                .filter(|r| r.status == RowStatus::Reserved && r.reservation.team_id == team)
                .map(|r| r.reservation.estimated_cost)
                .sum();
            if balance.saturating_sub(held) < reservation.estimated_cost {
                return Err(LedgerError::InsufficientBalance);
            }
        }
        rows.insert(
            reservation.request_id.clone(),
            MemoryRow {
                reservation: reservation.clone(),
                status: RowStatus::Reserved,
                prompt_tokens: 0,
                completion_tokens: 0,
                cost: 0,
                review: None,
                claimed: None,
                transitions: 0,
            },
        );
        Ok(())
    }

    async fn settle(&self, s: &Settlement) -> Result<SettleOutcome, LedgerError> {
        self.finish(
            &s.request_id,
            RowStatus::Settled,
            Some((s.prompt_tokens, s.completion_tokens, s.review)),
        )
    }

    async fn cancel(&self, request_id: &str) -> Result<SettleOutcome, LedgerError> {
        self.finish(request_id, RowStatus::Cancelled, None)
    }

    async fn entry(&self, request_id: &str) -> Result<Option<super::LedgerEntry>, LedgerError> {
        self.check()?;
        Ok(self.row(request_id).map(|r| super::LedgerEntry {
            model: r.reservation.model.clone(),
            bounds: r.reservation.bounds,
            status: match r.status {
                RowStatus::Reserved => super::EntryStatus::Reserved,
                RowStatus::Settled => super::EntryStatus::Settled {
                    prompt_tokens: r.prompt_tokens,
                    completion_tokens: r.completion_tokens,
                },
                RowStatus::Cancelled => super::EntryStatus::Cancelled,
            },
        }))
    }
}

#[cfg(test)]
pub(crate) use map_coordinator::MapCoordinator;

#[cfg(test)]
mod map_coordinator {
    //! Just enough coordination for the actors' tests: hashes land in a map, every limit
    //! admits, pub/sub carries nothing.
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use async_trait::async_trait;
    use tokio::sync::mpsc;

    use crate::ports::{CoordError, Coordinator, LimitVerdict};

    /// Just enough coordination for node actors: heartbeats land in a map. Pub/sub carries
    /// nothing unless made [`MapCoordinator::with_pubsub`]; its subscriptions stay open
    /// either way until [`MapCoordinator::drop_subscriptions`] (a dropped connection).
    #[derive(Debug, Default)]
    pub(crate) struct MapCoordinator(
        Mutex<BTreeMap<String, BTreeMap<String, String>>>,
        Mutex<PubSub>,
    );

    #[derive(Debug, Default)]
    pub(crate) struct PubSub {
        /// Messages reach subscribers (otherwise every publish reaches nobody).
        delivers: bool,
        /// It stands for Redis shared by replicas ([`Coordinator::is_shared`]).
        shared: bool,
        /// Subscribers by channel.
        channels: BTreeMap<String, Vec<mpsc::UnboundedSender<Vec<u8>>>>,
    }

    impl MapCoordinator {
        /// One whose pub/sub delivers messages.
        pub(crate) fn with_pubsub() -> Self {
            let c = Self::default();
            c.1.lock().unwrap().delivers = true;
            c
        }

        /// One standing for Redis shared by replicas: pub/sub delivers, and a missing record
        /// may be one it lost while the generation lives on elsewhere.
        pub(crate) fn shared() -> Self {
            let c = Self::with_pubsub();
            c.1.lock().unwrap().shared = true;
            c
        }

        /// Every hash is gone, as when Redis restarts empty.
        pub(crate) fn lose_everything(&self) {
            self.0.lock().unwrap().clear();
        }

        /// Every subscription ends, as when the pub/sub connection drops.
        pub(crate) fn drop_subscriptions(&self) {
            self.1.lock().unwrap().channels.clear();
        }
    }

    #[async_trait]
    impl Coordinator for MapCoordinator {
        fn is_shared(&self) -> bool {
            self.1.lock().unwrap().shared
        }
        async fn put_hash(
            &self,
            key: &str,
            fields: &BTreeMap<String, String>,
            _ttl: Duration,
        ) -> Result<(), CoordError> {
            self.0.lock().unwrap().insert(key.into(), fields.clone());
            Ok(())
        }
        async fn get_hash(
            &self,
            key: &str,
        ) -> Result<Option<BTreeMap<String, String>>, CoordError> {
            Ok(self.0.lock().unwrap().get(key).cloned())
        }
        async fn delete(&self, key: &str) -> Result<(), CoordError> {
            self.0.lock().unwrap().remove(key);
            Ok(())
        }
        async fn claim_hash(
            &self,
            key: &str,
            fields: &BTreeMap<String, String>,
            _ttl: Duration,
        ) -> Result<u64, CoordError> {
            let mut map = self.0.lock().unwrap();
            let fence = map
                .get(key)
                .and_then(|h| h.get("fence")?.parse::<u64>().ok())
                .unwrap_or(0)
                + 1;
            let mut fields = fields.clone();
            fields.insert("fence".into(), fence.to_string());
            map.insert(key.into(), fields);
            Ok(fence)
        }
        async fn put_hash_fenced(
            &self,
            key: &str,
            fields: &BTreeMap<String, String>,
            fence: u64,
            _ttl: Duration,
        ) -> Result<bool, CoordError> {
            let mut map = self.0.lock().unwrap();
            let held = map
                .get(key)
                .and_then(|h| h.get("fence")?.parse::<u64>().ok());
            if held.is_some_and(|held| held != fence) {
                return Ok(false);
            }
            let mut fields = fields.clone();
            fields.insert("fence".into(), fence.to_string());
            map.insert(key.into(), fields);
            Ok(true)
        }
        async fn delete_fenced(&self, key: &str, fence: u64) -> Result<bool, CoordError> {
            let mut map = self.0.lock().unwrap();
            let held = map
                .get(key)
                .and_then(|h| h.get("fence")?.parse::<u64>().ok());
            if held.is_some_and(|held| held != fence) {
                return Ok(false);
            }
            map.remove(key);
            Ok(true)
        }
        async fn acquire_lease(
            &self,
            _: &str,
            _: &str,
            _: Duration,
        ) -> Result<Option<u64>, CoordError> {
            Ok(Some(1))
        }
        async fn lease_holder(&self, _: &str) -> Result<Option<String>, CoordError> {
            Ok(None)
        }

        async fn release_lease(&self, _: &str, _: &str) -> Result<(), CoordError> {
            Ok(())
        }
        async fn incr(&self, _: &str, by: i64, _: Duration) -> Result<i64, CoordError> {
            Ok(by)
        }
        async fn acquire_slot(
            &self,
            _: &str,
            _: &str,
            _: u32,
            _: i64,
            _: Duration,
        ) -> Result<LimitVerdict, CoordError> {
            Ok(LimitVerdict {
                admitted: true,
                count: 1,
                wait_ms: 0,
            })
        }
        async fn release_slot(&self, _: &str, _: &str) -> Result<(), CoordError> {
            Ok(())
        }
        async fn window_admit(
            &self,
            _: &str,
            _: &str,
            _: i64,
            _: Duration,
            _: u32,
        ) -> Result<LimitVerdict, CoordError> {
            Ok(LimitVerdict {
                admitted: true,
                count: 1,
                wait_ms: 0,
            })
        }
        async fn publish(&self, channel: &str, payload: Vec<u8>) -> Result<usize, CoordError> {
            let mut pubsub = self.1.lock().unwrap();
            if !pubsub.delivers {
                return Ok(0);
            }
            let subs = pubsub.channels.entry(channel.to_owned()).or_default();
            subs.retain(|s| s.send(payload.clone()).is_ok());
            Ok(subs.len())
        }
        async fn subscribe(
            &self,
            channel: &str,
        ) -> Result<mpsc::UnboundedReceiver<Vec<u8>>, CoordError> {
            let (tx, rx) = mpsc::unbounded_channel();
            let mut pubsub = self.1.lock().unwrap();
            pubsub
                .channels
                .entry(channel.to_owned())
                .or_default()
                .push(tx);
            Ok(rx)
        }
    }
}
