//! The prefix cache inside the engine: a cached prefix is not prefilled again, so the time
//! to the first token falls with it; off, nothing is shared.

use super::*;

/// `params` whose prompt is the token ids `ids` (for their block hashes).
fn prompt(tok: &Arc<SimTokenizer>, ids: &[u32], max_tokens: u32) -> SeqParams {
    let mut p = params(tok, u32::try_from(ids.len()).unwrap(), max_tokens);
    p.block_hashes = kv::block_hashes(ids, BLOCK_SIZE);
    p
}

async fn ttft(engine: &EngineHandle, p: SeqParams) -> (Duration, Finish) {
    let start = Instant::now();
    let t = collect(engine.submit(p).unwrap()).await;
    (t.times[0].duration_since(start), t.finish.unwrap())
}

#[tokio::test(start_paused = true)]
async fn a_cached_prefix_is_not_prefilled_again() {
    let tok = SimTokenizer::load().unwrap();
    let (engine, _task) = EngineHandle::spawn(config(Profile::B8));
    let ids: Vec<u32> = (0..8000).collect();
    let (cold, first) = ttft(&engine, prompt(&tok, &ids, 4)).await;
    let (warm, second) = ttft(&engine, prompt(&tok, &ids, 4)).await;
    // 8,000 tokens are 500 blocks; the last token is always computed, so 499 can hit.
    assert_eq!(
        first.cache,
        CacheUse {
            cached: 0,
            created: 8000
        }
    );
    assert_eq!(
        second.cache,
        CacheUse {
            cached: 7984,
            created: 16
        }
    );
    assert!(warm * 4 < cold, "cold {cold:?}, warm {warm:?}");
    // A prompt that shares the first 100 blocks and then differs reads those only.
    let mut other = ids.clone();
    other[1600..].iter_mut().for_each(|t| *t += 50_000);
    let (_, third) = ttft(&engine, prompt(&tok, &other, 4)).await;
    assert_eq!(third.cache.cached, 1600);
    let s = engine.stats();
    assert_eq!(s.prefix_cache_queries, 24_000);
    assert_eq!(s.prefix_cache_hits, 7984 + 1600);
    assert_eq!(s.prompt_tokens_cached, 7984 + 1600);
}

#[tokio::test(start_paused = true)]
async fn without_prefix_caching_every_prompt_is_prefilled_whole() {
    let tok = SimTokenizer::load().unwrap();
    let mut cfg = config(Profile::B8);
    cfg.prefix_caching = false;
    let (engine, _task) = EngineHandle::spawn(cfg);
    // Off, the front end sends no hashes (`AppState::block_hashes`).
    let (cold, _) = ttft(&engine, params(&tok, 8000, 4)).await;
    let (again, f) = ttft(&engine, params(&tok, 8000, 4)).await;
    assert_eq!(f.cache, CacheUse::default());
    assert_eq!(again, cold);
    assert_eq!(engine.stats().prefix_cache_queries, 0);
}

#[tokio::test(start_paused = true)]
async fn a_full_cache_evicts_the_least_recently_freed_prefix_first() {
    let tok = SimTokenizer::load().unwrap();
    let mut cfg = config(Profile::B8);
    // Two 1,600-token prompts (100 full blocks each, and one for the token) fill it, beside
    // vLLM's null block.
    cfg.num_blocks = 203;
    cfg.max_model_len = 3200;
    let (engine, _task) = EngineHandle::spawn(cfg);
    let a: Vec<u32> = (0..1600).collect();
    let b: Vec<u32> = (100_000..101_600).collect();
    let c: Vec<u32> = (200_000..200_800).collect();
    ttft(&engine, prompt(&tok, &a, 1)).await;
    ttft(&engine, prompt(&tok, &b, 1)).await;
    // c takes 51 blocks (800 tokens and one for its token): the 2 free ones, then 49 of the
    // cached, a's (freed first), tail first. b, read again, hits its 99 and takes 2 more: the
    // free one and a's next. a keeps its first 50.
    ttft(&engine, prompt(&tok, &c, 1)).await;
    let (_, again_b) = ttft(&engine, prompt(&tok, &b, 1)).await;
    let (_, again_a) = ttft(&engine, prompt(&tok, &a, 1)).await;
    assert_eq!(again_b.cache.cached, 99 * 16, "b, freed last, is whole");
    assert_eq!(
        again_a.cache.cached,
        50 * 16,
        "a lost its tail, not its head"
    );
}
