//! Fuzzing what nodes can send: random sequences of frames — from the node holding the
//! attempt and from another registered node, for the live request and for others, of any
//! epoch, `seq` and count (2^64−1 included), and arbitrary text through the frame decoder —
//! interleaved with node loss, the client leaving and time passing. After every sequence:
//! nothing panicked, the row is final exactly once and billed within its bounds, the client
//! saw only the holder's text and at most one end, and no node was acked for an attempt it
//! never held. `SWITCHYARD_FUZZ_CASES` sets the number of sequences (64 by default); run
//! `SWITCHYARD_FUZZ_CASES=20000 cargo test -p switchyard-actors fuzz` at length (plain
//! `cargo test`: nextest stops a test after 5 minutes).

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::ports::UsageBounds;
use crate::protocol::decode_node_frame;

const BOUNDS: UsageBounds = UsageBounds {
    prompt_tokens: 50,
    completion_tokens: 8,
};

fn cases() -> u32 {
    std::env::var("SWITCHYARD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// A well-formed frame's contents.
#[derive(Debug, Clone)]
struct FrameSpec {
    kind: u8,
    other_request: bool,
    attempt: u64,
    seq: u64,
    prompt: u64,
    completion: u64,
    finish: u8,
}

#[derive(Debug, Clone)]
enum Op {
    /// A well-formed frame from node `from` (0 or 1 on this replica; 2 connected to another
    /// replica that shares the ledger and the coordinator).
    Frame { from: usize, spec: FrameSpec },
    /// Arbitrary text through the decoder, from node `from`.
    Text { from: usize, text: String },
    /// Node `from`'s connection ends.
    Lost { from: usize },
    /// The client leaves.
    ClientGone,
    /// Time passes.
    Advance { ms: u64 },
}

fn count() -> impl Strategy<Value = u64> {
    prop_oneof![0..20u64, Just(100_000u64), Just(1 << 62), Just(u64::MAX)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, 0..4u8, prop::bool::weighted(0.2), 0..4u64,
              prop_oneof![8 => 0..6u64, 1 => Just(u64::MAX - 1), 1 => Just(u64::MAX)],
              count(), count(), 0..5u8)
            .prop_map(|(from, kind, other_request, attempt, seq, prompt, completion, finish)| {
                Op::Frame {
                    from,
                    spec: FrameSpec { kind, other_request, attempt, seq, prompt, completion, finish },
                }
            }),
        2 => (0..3usize, prop_oneof![
                ".{0,80}",
                r#"\{"type":"(done|chunk|accepted|error)","request_id":"r1","attempt":[0-3],"seq":[0-9],"prompt_tokens":-?[0-9]{1,25}(\.5)?,"completion_tokens":-?[0-9]{1,25},"finish_reason":"stop","delta":"x","code":"c","message":"m"\}"#,
            ]).prop_map(|(from, text)| Op::Text { from, text }),
        1 => (0..3usize).prop_map(|from| Op::Lost { from }),
        1 => Just(Op::ClientGone),
        2 => (1..8_000u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// What the test saw of one node's socket.
#[derive(Default)]
struct Seen {
    /// (request, attempt) it was assigned.
    assigned: BTreeSet<(String, u64)>,
    /// (request, attempt) it was acked.
    acked: Vec<(String, u64)>,
}

fn drain_into(out: &mut mpsc::Receiver<ServerFrame>, seen: &mut Seen) {
    while let Ok(f) = out.try_recv() {
        match f {
            ServerFrame::Assign {
                request_id,
                attempt,
                ..
            } => {
                seen.assigned.insert((request_id, attempt));
            }
            ServerFrame::Ack {
                request_id,
                attempt,
            } => seen.acked.push((request_id, attempt)),
            _ => {}
        }
    }
}

impl FrameSpec {
    fn frame(&self, from: usize) -> NodeFrame {
        let id = if self.other_request { "r2" } else { "r1" };
        let (attempt, seq) = (self.attempt, self.seq);
        let code = ["model_backend_error", "invalid_request", "model_loading"]
            [usize::from(self.finish % 3)];
        let finish = ["stop", "length", "abort", "error", "weird"][usize::from(self.finish % 5)];
        match self.kind {
            0 => NodeFrame::Accepted {
                request_id: id.into(),
                attempt,
            },
            // The text names its sender and attempt, so the client's view can be checked.
            1 => chunk(id, attempt, seq, &format!("[n{from}:{attempt}:{seq}]")),
            2 => done(id, attempt, self.prompt, self.completion, finish),
            _ => NodeFrame::Error {
                request_id: id.into(),
                attempt,
                code: code.into(),
                message: "fuzz".into(),
            },
        }
    }
}

async fn run(ops: Vec<Op>) {
    let h = harness(8, 4).await;
    let mut nodes = Vec::new();
    let mut outs = Vec::new();
    for id in ["n0", "n1"] {
        let (node, out) = connect(&h, id).await;
        nodes.push(Some(node));
        outs.push(out);
    }
    // A node held by another replica: no queue of this one routes to it, and its replica
    // has no live generation (its own directory is empty).
    let (tx, out) = mpsc::channel(64);
    let elsewhere = NodeActor::start(NodeArgs {
        node_id: "n2".into(),
        models: vec![MODEL.into()],
        link: crate::node::Link::Socket(tx),
        queues: BTreeMap::new(),
        directory: Directory::default(),
        ledger: h.ledger.clone(),
        lifecycle: None,
        coordinator: h.coord.clone(),
        replica_id: "r2".into(),
        heartbeat_timeout: Duration::from_secs(15),
        clock: Arc::new(SystemClock),
        trust: crate::node::NodeTrust::default(),
        protocol: crate::protocol::PROTOCOL_VERSION,
        gpus: 0,
        accounting: None,
        capacity: BTreeMap::new(),
    })
    .await
    .unwrap();
    nodes.push(Some(elsewhere));
    outs.push(out);
    let mut seen = [Seen::default(), Seen::default(), Seen::default()];
    // Short deadlines, so that a sequence ends in seconds of paused time.
    let timeouts = Timeouts {
        first_token: Duration::from_secs(10),
        total: Duration::from_secs(30),
        cancel_grace: Duration::from_secs(2),
        settle_wait: Duration::from_secs(5),
        lease: Duration::from_secs(1),
    };
    let mut stream = Some(start_timed(&h, "r1", None, BOUNDS, timeouts).await.unwrap());
    let mut events = Vec::new();
    settle_a_moment().await;
    for op in ops {
        match op {
            Op::Frame { from, spec } => {
                if let Some(n) = &nodes[from] {
                    n.deliver(spec.frame(from));
                }
            }
            Op::Text { from, text } => {
                if let (Some(n), Ok(mut f)) = (&nodes[from], decode_node_frame(&text)) {
                    // Text names its sender, so the client's view can be checked.
                    if let NodeFrame::Chunk {
                        attempt,
                        seq,
                        delta,
                        ..
                    } = &mut f
                    {
                        *delta =
                            crate::output::WireDelta::Text(format!("[n{from}:{attempt}:{seq}]"));
                    }
                    n.deliver(f);
                }
            }
            Op::Lost { from } => {
                if let Some(n) = nodes[from].take() {
                    n.connection_lost();
                }
            }
            Op::ClientGone => stream = None,
            Op::Advance { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
        settle_a_moment().await;
        for (out, seen) in outs.iter_mut().zip(seen.iter_mut()) {
            drain_into(out, seen);
        }
        if let Some(s) = &mut stream {
            while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(1), s.next()).await {
                events.push(e);
            }
        }
    }
    // Every deadline passes: the generation must end whatever was sent.
    tokio::time::sleep(Duration::from_secs(40)).await;
    for (out, seen) in outs.iter_mut().zip(seen.iter_mut()) {
        drain_into(out, seen);
    }
    if let Some(s) = &mut stream {
        while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(1), s.next()).await {
            events.push(e);
        }
    }

    let row = h.ledger.row("r1").expect("the row exists");
    assert_ne!(
        row.status,
        RowStatus::Reserved,
        "final after every deadline"
    );
    assert_eq!(row.transitions, 1, "final exactly once");
    assert!(row.prompt_tokens <= BOUNDS.prompt_tokens);
    assert!(row.completion_tokens <= BOUNDS.completion_tokens);
    assert!(
        h.ledger.row("r2").is_none(),
        "no row for a request never admitted"
    );
    for (i, seen) in seen.iter().enumerate() {
        for ack in &seen.acked {
            assert!(
                seen.assigned.contains(ack),
                "n{i} acked for {ack:?} it never held: {:?}",
                seen.assigned
            );
        }
    }
    let terminal = events
        .iter()
        .filter(|e| !matches!(e, GenEvent::Delta(_)))
        .count();
    assert!(terminal <= 1, "{events:?}");
    if terminal == 1 {
        assert!(!matches!(events.last(), Some(GenEvent::Delta(_))));
    }
    for e in &events {
        if let GenEvent::Failed(f) = e {
            assert_ne!(
                f.message, "The generation failed inside the server.",
                "the generation crashed"
            );
        }
        if let GenEvent::Delta(crate::output::Piece { text, .. }) = e {
            // `[n{from}:{attempt}:{seq}]`: only the holder of that attempt is believed.
            let inner = text.trim_start_matches('[').trim_end_matches(']');
            let mut parts = inner.split(':');
            let (Some(from), Some(attempt)) = (parts.next(), parts.next()) else {
                panic!("unexpected text {text}")
            };
            let from: usize = from.trim_start_matches('n').parse().unwrap();
            let attempt: u64 = attempt.parse().unwrap();
            assert!(
                seen[from].assigned.contains(&("r1".to_owned(), attempt)),
                "the client saw {text} from a node not holding that attempt"
            );
        }
        if let GenEvent::Finished(u) | GenEvent::Cancelled(u) = e {
            assert_eq!(
                (u.prompt_tokens, u.completion_tokens),
                (row.prompt_tokens, row.completion_tokens),
                "the client is told what the ledger holds"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn any_frames_from_any_node_keep_the_money_and_the_stream_right(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(run(ops));
    }

    #[test]
    fn the_frame_decoder_takes_any_text(text in ".{0,300}", bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode_node_frame(&text);
        let _ = decode_node_frame(&String::from_utf8_lossy(&bytes));
    }
}
