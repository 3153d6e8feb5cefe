//! A dispatch carries the node's slot the queue counted: lost on its way — the generation
//! stopped as it arrived, its mailbox dropped with it — the slot goes back to the queue.
//! (Under a PostgreSQL outage, generations refused by the ledger stopped while the cluster's
//! queue owner dispatched them; every node's count filled up with nothing running, and the
//! platform served nothing after the database came back.)

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::*;
use crate::protocol::Api;

/// A generation that stops at its first message and ignores it: what a dispatch meets when
/// it reaches a generation that is ending.
struct Stopping;

impl Actor for Stopping {
    type Msg = GenerationMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _: ActorRef<GenerationMsg>,
        (): (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<GenerationMsg>,
        _msg: GenerationMsg,
        (): &mut (),
    ) -> Result<(), ActorProcessingErr> {
        myself.stop(None);
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_dispatch_its_generation_never_takes_gives_the_slot_back() {
    let h = harness(8, 1).await;
    let (node, mut out) = connect(&h, "n1").await;
    for id in ["gone-1", "gone-2", "gone-3"] {
        let (gone, _) = Actor::spawn(None, Stopping, ()).await.unwrap();
        h.queue
            .enqueue(
                id,
                gone,
                crate::model_queue::Ask {
                    front: false,
                    avoid: None,
                    api: Api::Chat,
                    route: None,
                    ticket: Default::default(),
                },
            )
            .await
            .unwrap();
        settle_a_moment().await;
        let stats = h.queue.stats().await.unwrap();
        assert_eq!(
            stats.nodes,
            vec![("n1".to_owned(), 0, false)],
            "{id}: the dispatch was lost, its slot must be back"
        );
    }
    // The node's one slot is free: a real generation runs on it.
    let mut real = start(&h, "real").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("real".into(), 1));
    node.deliver(done("real", 1, 10, 0, "stop"));
    assert!(matches!(real.next().await, Some(GenEvent::Finished(_))));
}
