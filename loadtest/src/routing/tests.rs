//! The benchmark's own checks, on short virtual runs (a second or two of real time): the
//! figures are deterministic for a seed, so these are comparisons, not timings.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn opts(scenario: &str, strategies: Vec<Strategy>) -> RoutingOptions {
    RoutingOptions {
        out: std::env::temp_dir(),
        seed: 11,
        scenarios: vec![scenario.into()],
        loads: vec![0.9],
        warmup: Duration::from_secs(30),
        window: Duration::from_secs(60),
        strategies,
        llmd_node_concurrency: 256,
        llmd_shape: LlmdShape::default(),
    }
}

fn row<'a>(rows: &'a [Row], strategy: Strategy, model: &str) -> &'a Row {
    rows.iter()
        .find(|r| r.strategy == strategy && r.model == model)
        .expect("a row")
}

#[test]
fn cache_aware_keeps_conversations_on_their_cache_and_matches_the_oracle() {
    let opts = opts("mix", Strategy::ALL.to_vec());
    let tok = SimTokenizer::load().unwrap();
    let models = seeds_fleet();
    let rt = runtime().unwrap();
    let capacity = rt.block_on(capacity(&opts, &models, &Mix::default(), tok.clone()));
    assert!(capacity.iter().all(|c| *c > 0.0), "{capacity:?}");
    let mut rows = Vec::new();
    for s in Strategy::ALL {
        rows.extend(
            runtime()
                .unwrap()
                .block_on(mix(&opts, s, 0.9, &capacity, tok.clone())),
        );
    }
    let rr = row(&rows, Strategy::RoundRobin, "8b");
    let ca = row(&rows, Strategy::CacheAware, "8b");
    let oracle = row(&rows, Strategy::Oracle, "8b");
    assert!(rr.requests > 100 && ca.requests > 100, "{rr:?} {ca:?}");
    assert!(
        ca.hit_rate > rr.hit_rate + 0.1,
        "hit rate {} vs round robin {}",
        ca.hit_rate,
        rr.hit_rate
    );
    assert!(
        ca.hit_rate > oracle.hit_rate - 0.1 * oracle.hit_rate,
        "{ca:?} {oracle:?}"
    );
    assert!(ca.ttft_p95 < rr.ttft_p95, "{ca:?} {rr:?}");
    assert!(rows.iter().all(|r| r.refused == 0), "{rows:?}");
    assert_eq!(ca.preemptions, 0);
    // The fleet's row pools every model's requests: its p95 lies between theirs.
    for s in Strategy::ALL {
        let all = row(&rows, s, ALL_MODELS);
        let models: Vec<&Row> = rows
            .iter()
            .filter(|r| r.strategy == s && r.model != ALL_MODELS)
            .collect();
        assert_eq!(models.len(), 3);
        assert_eq!(all.requests, models.iter().map(|r| r.requests).sum::<u64>());
        let lo = models.iter().map(|r| r.ttft_p95).fold(f64::MAX, f64::min);
        let hi = models.iter().map(|r| r.ttft_p95).fold(0.0, f64::max);
        assert!(
            lo <= all.ttft_p95 && all.ttft_p95 <= hi,
            "{all:?} {models:?}"
        );
    }
    let (rr, ca) = (
        row(&rows, Strategy::RoundRobin, ALL_MODELS),
        row(&rows, Strategy::CacheAware, ALL_MODELS),
    );
    assert!(ca.ttft_p95 < rr.ttft_p95, "{ca:?} {rr:?}");
}

#[test]
fn strategies_parse_by_their_table_names() {
    for s in Strategy::ALL {
        assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
    }
    assert!("random".parse::<Strategy>().is_err());
}

#[test]
fn on_a_shared_prefix_fleet_cache_aware_serves_more_than_round_robin() {
    let opts = opts(
        "llm-d-short",
        vec![Strategy::RoundRobin, Strategy::CacheAware],
    );
    let tok = SimTokenizer::load().unwrap();
    let run = |s| {
        runtime().unwrap().block_on(llmd(
            &opts,
            "llm-d-short",
            LLMD_SHORT_OUTPUT,
            s,
            tok.clone(),
        ))
    };
    let rr = run(Strategy::RoundRobin);
    let ca = run(Strategy::CacheAware);
    assert!(
        ca[0].output_tokens_per_s > 1.5 * rr[0].output_tokens_per_s,
        "{ca:?} {rr:?}"
    );
    assert!(ca[0].hit_rate > rr[0].hit_rate + 0.3, "{ca:?} {rr:?}");
    // The shape is the options': with questions of 100 tokens instead of 1,200 the shared
    // prefix is more of every prompt, and more of it is read from the cache.
    let short = RoutingOptions {
        llmd_shape: LlmdShape {
            question: 100,
            ..LlmdShape::default()
        },
        ..opts.clone()
    };
    let ca_short = runtime().unwrap().block_on(llmd(
        &short,
        "llm-d-short",
        LLMD_SHORT_OUTPUT,
        Strategy::CacheAware,
        tok.clone(),
    ));
    assert!(ca_short[0].hit_rate > ca[0].hit_rate, "{ca_short:?} {ca:?}");
}

#[test]
fn the_table_has_a_line_per_row() {
    let report = RoutingReport {
        command: "routing".into(),
        date: "2026-12-05T00:00:00Z".into(),
        seed: 1,
        warmup_s: 1.0,
        window_s: 1.0,
        capacity_sessions_per_s: vec![],
        llmd_shape: LlmdShape::default(),
        rows: vec![Row {
            scenario: "mix".into(),
            strategy: Strategy::CacheAware,
            load: 0.9,
            model: "8b".into(),
            requests: 10,
            refused: 0,
            ttft_p50: 0.1,
            ttft_p95: 0.2,
            ttft_mean: 0.15,
            hit_rate: 0.8,
            preemptions: 0,
            tokens_per_gpu_s: 500.0,
            output_tokens_per_s: 3000.0,
        }],
        wall_s: 1.0,
    };
    let t = table(&report);
    assert_eq!(t.lines().count(), 3);
    assert!(t.contains(
        "| mix | 90 % | 8b | cache_aware | 0.10 | 0.20 | 0.15 | 80.0 % | 0 | 500 | 10 | 0 |"
    ));
}
