//! Engine tests on tokio's paused clock: virtual time makes the calibration figures exact and
//! the tests fast and deterministic.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

use super::*;
use crate::sim::BLOCK_SIZE;
use crate::sim::profile::Profile;
use crate::sim::tokenizer::SimTokenizer;

fn config(profile: Profile) -> EngineConfig {
    EngineConfig::modeled(profile.spec(), BLOCK_SIZE)
}

fn params(tok: &Arc<SimTokenizer>, prompt_tokens: u32, max_tokens: u32) -> SeqParams {
    SeqParams {
        prompt_tokens,
        max_tokens,
        eos_at: None,
        generator: Generator::new(tok.clone(), u64::from(prompt_tokens), vec![]),
        crash_after: None,
        stall_after: None,
        first_token_delay: Duration::ZERO,
        block_hashes: Vec::new(),
    }
}

/// What one sequence saw: token arrival times, and how it ended.
#[derive(Debug, Default)]
struct Trace {
    times: Vec<Instant>,
    finish: Option<Finish>,
    crashed: bool,
}

async fn collect(mut rx: UnboundedReceiver<SeqEvent>) -> Trace {
    let mut t = Trace::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token { finish, .. } => {
                t.times.push(Instant::now());
                if finish.is_some() {
                    t.finish = finish;
                    break;
                }
            }
            SeqEvent::Crashed => {
                t.crashed = true;
                break;
            }
        }
    }
    t
}

fn per_stream_rate(t: &Trace) -> f64 {
    let (first, last) = (t.times[0], t.times[t.times.len() - 1]);
    (t.times.len() - 1) as f64 / last.duration_since(first).as_secs_f64()
}

async fn run_batch(profile: Profile, streams: usize, max_tokens: u32) -> (Vec<Trace>, Duration) {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(profile));
    let start = Instant::now();
    let handles: Vec<_> = (0..streams)
        .map(|_| {
            tokio::spawn(collect(
                engine.submit(params(&tok, 32, max_tokens)).unwrap(),
            ))
        })
        .collect();
    let mut traces = Vec::new();
    for h in handles {
        traces.push(h.await.unwrap());
    }
    (traces, start.elapsed())
}

#[tokio::test(start_paused = true)]
async fn eight_b_at_32_streams_decodes_47_per_stream_and_1500_total() {
    let (traces, elapsed) = run_batch(Profile::B8, 32, 200).await;
    for t in &traces {
        assert_eq!(t.finish.as_ref().unwrap().completion_tokens, 200);
        let rate = per_stream_rate(t);
        assert!((rate - 47.0).abs() < 1.0, "per-stream {rate}");
    }
    let total = 32.0 * 200.0 / elapsed.as_secs_f64();
    assert!((total - 1500.0).abs() < 150.0, "total {total}");
}

#[tokio::test(start_paused = true)]
async fn batching_curve_rises_with_batch_size() {
    let mut totals = Vec::new();
    for b in [1, 8, 32, 64] {
        let (traces, _) = run_batch(Profile::B8, b, 50).await;
        let per_stream = per_stream_rate(&traces[0]);
        totals.push(per_stream * b as f64);
    }
    assert!(totals.windows(2).all(|w| w[1] > w[0] * 1.5), "{totals:?}");
}

#[tokio::test(start_paused = true)]
async fn seventy_b_at_8_streams_totals_300() {
    let (traces, _) = run_batch(Profile::B70, 8, 100).await;
    let total: f64 = traces.iter().map(per_stream_rate).sum();
    assert!((total - 300.0).abs() < 15.0, "total {total}");
}

/// Admits `n` sequences of `prompt` tokens and returns (running, waiting, preemptions) once
/// admission has settled.
async fn admit(
    n: usize,
    prompt: u32,
    max_tokens: u32,
) -> (u64, u64, u64, Vec<UnboundedReceiver<SeqEvent>>) {
    let tok = SimTokenizer::load().unwrap();
    // A budget that prefills every prompt in one step: the KV cache is the only limit.
    let mut cfg = config(Profile::B8);
    cfg.max_num_batched_tokens = 1 << 20;
    let (engine, _task) = EngineHandle::spawn(cfg);
    let rxs: Vec<_> = (0..n)
        .map(|_| engine.submit(params(&tok, prompt, max_tokens)).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let s = engine.stats();
    (s.running, s.waiting_capacity, s.preemptions, rxs)
}

#[tokio::test(start_paused = true)]
async fn ninety_streams_at_2k_fit_and_the_91st_waits() {
    let (running, waiting, preemptions, _rx) = admit(91, 2032, 16).await;
    assert_eq!((running, waiting, preemptions), (90, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn twenty_two_streams_at_8k_fit_and_the_23rd_waits() {
    let (running, waiting, preemptions, _rx) = admit(23, 8176, 16).await;
    assert_eq!((running, waiting, preemptions), (22, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn growing_past_the_cache_preempts_and_every_sequence_still_completes() {
    let tok = SimTokenizer::load().unwrap();
    let mut cfg = config(Profile::B8);
    cfg.num_blocks = 64;
    cfg.max_model_len = 1024;
    let (engine, _task) = EngineHandle::spawn(cfg);
    let handles: Vec<_> = (0..4)
        .map(|_| tokio::spawn(collect(engine.submit(params(&tok, 100, 400)).unwrap())))
        .collect();
    for h in handles {
        let t = h.await.unwrap();
        assert_eq!(t.finish.unwrap().completion_tokens, 400);
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let s = engine.stats();
    assert!(
        s.preemptions > 0,
        "4 x 500 tokens cannot share 1,024: preemption expected"
    );
    assert_eq!(s.used_blocks, 0);
    assert_eq!(s.generation_tokens, 1600);
}

#[tokio::test(start_paused = true)]
async fn max_num_seqs_caps_the_batch() {
    let tok = SimTokenizer::load().unwrap();
    let mut cfg = config(Profile::B8);
    cfg.max_num_seqs = 8;
    let (engine, _task) = EngineHandle::spawn(cfg);
    let _rx: Vec<_> = (0..12)
        .map(|_| engine.submit(params(&tok, 32, 100)).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let s = engine.stats();
    assert_eq!((s.running, s.waiting_capacity), (8, 4));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_receiver_frees_its_sequence_within_one_step() {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(Profile::B8));
    let mut rx = engine.submit(params(&tok, 32, 1000)).unwrap();
    rx.recv().await.unwrap();
    assert_eq!(engine.stats().running, 1);
    drop(rx);
    let step = Profile::B8.spec().step_duration(1, 0);
    tokio::time::sleep(step * 2).await;
    let s = engine.stats();
    assert_eq!((s.running, s.used_blocks), (0, 0));
    assert!(
        s.generation_tokens <= 3,
        "stopped generating: {}",
        s.generation_tokens
    );
    assert_eq!(
        s.success.iter().sum::<u64>(),
        0,
        "an abort is not a success, as in vLLM"
    );
}

#[tokio::test(start_paused = true)]
async fn crash_fault_cuts_after_n_tokens() {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(Profile::B8));
    let mut p = params(&tok, 32, 100);
    p.crash_after = Some(3);
    let t = collect(engine.submit(p).unwrap()).await;
    assert!(t.crashed);
    assert_eq!(t.times.len(), 3);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(engine.stats().used_blocks, 0);
}

#[tokio::test(start_paused = true)]
async fn stall_fault_keeps_the_slot_until_the_client_leaves() {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(Profile::B8));
    let mut p = params(&tok, 32, 100);
    p.stall_after = Some(2);
    let mut rx = engine.submit(p).unwrap();
    for _ in 0..2 {
        assert!(matches!(
            rx.recv().await,
            Some(SeqEvent::Token { finish: None, .. })
        ));
    }
    let waited = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
    assert!(waited.is_err(), "a stalled sequence sends nothing");
    assert_eq!(engine.stats().running, 1);
    drop(rx);
    tokio::time::sleep(IDLE_TICK * 2).await;
    assert_eq!(engine.stats().running, 0);
}

#[tokio::test(start_paused = true)]
async fn slow_first_token_defers_the_sequence() {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(Profile::B8));
    let mut p = params(&tok, 32, 4);
    p.first_token_delay = Duration::from_secs(2);
    let start = Instant::now();
    let rx = engine.submit(p).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(engine.stats().waiting_deferred, 1);
    let t = collect(rx).await;
    assert!(t.times[0].duration_since(start) >= Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn generation_stops_at_the_context_limit() {
    let tok = SimTokenizer::load().unwrap();
    let mut cfg = config(Profile::B8);
    cfg.max_model_len = 1024;
    let (engine, _task) = EngineHandle::spawn(cfg);
    let t = collect(engine.submit(params(&tok, 997, 27)).unwrap()).await;
    let f = t.finish.unwrap();
    assert_eq!(
        (f.completion_tokens, f.reason),
        (27, FinishedReason::Length)
    );
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_long_prompts_is_admitted_within_the_step_budget() {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(Profile::B8));
    let _rx: Vec<_> = (0..10)
        .map(|_| engine.submit(params(&tok, 2000, 100)).unwrap())
        .collect();
    // The first step holds 2,048 prompt tokens: one whole prompt and the start of the next.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let s = engine.stats();
    assert_eq!((s.running, s.waiting_capacity), (2, 8));
}

#[tokio::test(start_paused = true)]
async fn end_of_sequence_finishes_with_stop_and_no_stop_reason() {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(Profile::B8));
    let mut p = params(&tok, 32, 100);
    p.eos_at = Some(9);
    let t = collect(engine.submit(p).unwrap()).await;
    let f = t.finish.unwrap();
    assert_eq!(
        (f.completion_tokens, f.reason, f.stop),
        (9, FinishedReason::Stop, None)
    );
}

mod prefix;
