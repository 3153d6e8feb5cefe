//! `switchyard_settled_tokens_total` counts every row a settle applies, once, whichever path
//! settled it: the live generation, or a `done` that found none (an orphan: its generation
//! gone with a replica, or relayed from one). A `done` resent after its row is final adds
//! nothing.

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::overlap::{gated, start_gated};
use super::*;
use crate::metric_names::SETTLED_TOKENS_TOTAL;
use crate::test_counter::CounterCell;

/// `switchyard_settled_tokens_total` by (`model`, `kind`), on the test's only thread (a
/// paused-clock test runs every actor there).
#[derive(Debug, Default)]
struct Settled(Mutex<BTreeMap<(String, String), Arc<AtomicU64>>>);

impl Settled {
    /// (prompt, completion) counted for `MODEL`.
    fn counted(&self) -> (u64, u64) {
        let of = |kind: &str| {
            self.0
                .lock()
                .unwrap()
                .get(&(MODEL.to_owned(), kind.to_owned()))
                .map_or(0, |c| c.load(Ordering::Relaxed))
        };
        (of("prompt"), of("completion"))
    }
}

impl Recorder for Settled {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() != SETTLED_TOKENS_TOTAL {
            return Counter::noop();
        }
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_owned())
                .unwrap_or_default()
        };
        let cell = self
            .0
            .lock()
            .unwrap()
            .entry((label("model"), label("kind")))
            .or_default()
            .clone();
        Counter::from_arc(Arc::new(CounterCell(cell)))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[tokio::test(start_paused = true)]
async fn a_live_generation_and_an_orphan_done_each_count_their_row_once() {
    let counted = Settled::default();
    let _recorder = metrics::set_default_local_recorder(&counted);
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;

    // The live generation settles its own row.
    let mut live = start(&h, "r0").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r0".into(), 1));
    node.deliver(done("r0", 1, 12, 2, "stop"));
    while let Some(ev) = live.next().await {
        if matches!(ev, GenEvent::Finished(_)) {
            break;
        }
    }
    settle_a_moment().await;
    assert_eq!(h.ledger.row("r0").unwrap().status, RowStatus::Settled);
    assert_eq!(counted.counted(), (12, 2), "the live generation's settle");
    while out.try_recv().is_ok() {}

    // The generation is gone before its row committed; the row commits, and the node's
    // `done` settles it without a generation.
    let ledger = gated(&h, false);
    let started = start_gated(&h, "r1", ledger.clone());
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    h.gens.stop();
    settle_a_moment().await;
    assert!(started.await.unwrap().is_err());
    ledger.gate.add_permits(1);
    settle_a_moment().await;
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Reserved);
    node.deliver(done("r1", 1, 30, 7, "stop"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Settled);
    assert_eq!(
        counted.counted(),
        (12 + 30, 2 + 7),
        "the orphan settle is counted as the generation's own would be"
    );

    // Its resent copy finds the row final: acked, billed and counted nothing more.
    node.deliver(done("r1", 1, 30, 7, "stop"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    assert_eq!(counted.counted(), (42, 9), "a row is counted once");
}
