//! A client that leaves and one that comes back within the grace, and a settle that fails:
//! retried on a timer while the actor keeps answering.

use super::*;

#[tokio::test(start_paused = true)]
async fn a_client_back_within_the_grace_keeps_the_generation_running() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    let mut stream = start_recorded(&h, "r1", &store).await;
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "a"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("a".into())));
    let generation = h.gens.directory().get("r1").unwrap();
    generation.cast(GenerationMsg::ClientGone).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    generation.cast(GenerationMsg::ClientBack).unwrap();
    tokio::time::sleep(Timeouts::default().cancel_grace * 2).await;
    assert!(
        out.try_recv().is_err(),
        "no cancel for a client that came back"
    );
    node.deliver(chunk("r1", 1, 1, "b"));
    node.deliver(done("r1", 1, 12, 2, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("b".into())));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
}

#[tokio::test(start_paused = true)]
async fn a_client_back_after_the_cancel_went_out_changes_nothing() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    let mut stream = start_recorded(&h, "r1", &store).await;
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "a"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("a".into())));
    let generation = h.gens.directory().get("r1").unwrap();
    generation.cast(GenerationMsg::ClientGone).unwrap();
    assert!(matches!(
        out.recv().await,
        Some(ServerFrame::Cancel { attempt: 1, .. })
    ));
    generation.cast(GenerationMsg::ClientBack).unwrap();
    node.deliver(done("r1", 1, 12, 1, "abort"));
    // The terminal event still reaches the sender (a resumed stream would read it).
    assert!(matches!(stream.next().await, Some(GenEvent::Cancelled(_))));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!((row.status, row.completion_tokens), (RowStatus::Settled, 1));
}

#[tokio::test(start_paused = true)]
async fn a_settle_that_fails_is_retried_after_a_backoff_without_blocking_the_actor() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "a"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("a".into())));
    h.ledger.set_unavailable(true);
    node.deliver(done("r1", 1, 12, 1, "stop"));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Reserved);
    // Between tries the actor answers at once: a stray admission is dropped unanswered
    // (sender error), not held up behind a sleep (timeout).
    let generation = h.gens.directory().get("r1").unwrap();
    let answered = generation
        .call(GenerationMsg::Admit, Some(Duration::from_millis(10)))
        .await
        .unwrap();
    assert!(
        matches!(answered, ractor::rpc::CallResult::SenderError),
        "{answered:?}"
    );
    h.ledger.set_unavailable(false);
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (row.status, row.completion_tokens, row.transitions),
        (RowStatus::Settled, 1, 1)
    );
}
