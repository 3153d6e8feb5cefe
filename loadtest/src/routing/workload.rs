//! The routing benchmark's traffic: sessions whose prompts share prefixes the way a company's
//! traffic does. Prompts are token ids (the engine and the router only see their block
//! hashes), built so that equal text is equal ids:
//! - **chat**: a multi-turn conversation under one of a few long application system prompts;
//!   each turn's prompt is the whole conversation so far (earlier replies included) plus a new
//!   user message, after a pause to read and type;
//! - **agent**: a tool-calling loop under one of a few long tool lists; each step appends the
//!   last tool call and its (long) result, after a short tool run;
//! - **one-shot**: a retrieval question, a short shared instruction and a document of its own.
//!
//! Everything is drawn from one seeded generator per session, so a run is replayable and every
//! strategy of a run sees exactly the same sessions at the same times.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Shared system prompts of chat applications, per model.
const CHAT_APPS: u64 = 8;
/// Shared tool lists of agent frameworks, per model.
const AGENT_KINDS: u64 = 3;
/// Shared instructions of retrieval pipelines, per model.
const RAG_KINDS: u64 = 4;

/// One request of a session, before it is sent.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub output: u32,
    /// Seconds after the previous turn ended (or after the session began, for the first).
    pub pause: f64,
}

/// Where a session's prompt grows from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A multi-turn conversation.
    Chat,
    /// A tool-calling loop.
    Agent,
    /// A single retrieval question.
    OneShot,
}

/// The traffic mix and its lengths; one per benchmark.
#[derive(Debug, Clone)]
pub struct Mix {
    /// Share of sessions that are chats, agents and one-shots (the rest).
    pub chat: f64,
    /// See `chat`.
    pub agent: f64,
    /// The context limit: a session ends before its prompt and output would pass it.
    pub max_model_len: u32,
}

impl Default for Mix {
    fn default() -> Self {
        Self {
            chat: 0.5,
            agent: 0.2,
            max_model_len: 8192,
        }
    }
}

/// Ids of a shared text: the same `(model, family, which)` is the same ids.
fn shared(model: u64, family: u64, which: u64, len: u32) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64((model << 40) ^ (family << 32) ^ which);
    (0..len).map(|_| rng.random_range(1_000..120_000)).collect()
}

/// Ids of a text of its own.
fn fresh(rng: &mut ChaCha8Rng, len: u32) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(1_000..120_000)).collect()
}

/// The lengths of a shared prefix `which` of a family: fixed per prefix.
fn shared_len(model: u64, family: u64, which: u64, lo: u32, hi: u32) -> u32 {
    let mut rng = ChaCha8Rng::seed_from_u64((model << 40) ^ (family << 32) ^ which ^ 0x5eed);
    rng.random_range(lo..=hi)
}

/// The turns of session `n` of `model` (an index into the fleet's models) under `mix`.
pub fn session(model: u64, n: u64, seed: u64, mix: &Mix) -> (Kind, Vec<Turn>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (model << 48) ^ n.wrapping_mul(0x9E37_79B9));
    let x: f64 = rng.random();
    let limit = mix.max_model_len.saturating_sub(64);
    if x < mix.chat {
        let app = rng.random_range(0..CHAT_APPS);
        let mut prompt = shared(model, 1, app, shared_len(model, 1, app, 600, 2_500));
        let turns = 1 + geometric(&mut rng, 0.28).min(11);
        let mut out = Vec::new();
        for t in 0..turns {
            let user = rng.random_range(20..400);
            let output = rng.random_range(60..500);
            prompt.extend(fresh(&mut rng, user));
            if prompt.len() as u32 + output > limit {
                break;
            }
            let pause = if t == 0 { 0.0 } else { exp(&mut rng, 12.0) };
            out.push(Turn {
                prompt: prompt.clone(),
                output,
                pause,
            });
            // The reply becomes part of the next turn's prompt.
            prompt.extend(fresh(&mut rng, output));
        }
        (Kind::Chat, out)
    } else if x < mix.chat + mix.agent {
        let kind = rng.random_range(0..AGENT_KINDS);
        let mut prompt = shared(model, 2, kind, shared_len(model, 2, kind, 2_500, 4_000));
        let task = rng.random_range(50..300);
        prompt.extend(fresh(&mut rng, task));
        let steps = rng.random_range(3..14);
        let mut out = Vec::new();
        for s in 0..steps {
            let output = rng.random_range(30..200);
            if prompt.len() as u32 + output > limit {
                break;
            }
            let pause = if s == 0 { 0.0 } else { exp(&mut rng, 1.5) };
            out.push(Turn {
                prompt: prompt.clone(),
                output,
                pause,
            });
            // The tool call, then the tool's result.
            prompt.extend(fresh(&mut rng, output));
            let result = rng.random_range(100..800);
            prompt.extend(fresh(&mut rng, result));
        }
        (Kind::Agent, out)
    } else {
        let kind = rng.random_range(0..RAG_KINDS);
        let mut prompt = shared(model, 3, kind, shared_len(model, 3, kind, 150, 400));
        let document = rng.random_range(400..2_500);
        prompt.extend(fresh(&mut rng, document));
        let output = rng.random_range(100..400);
        (
            Kind::OneShot,
            vec![Turn {
                prompt,
                output,
                pause: 0.0,
            }],
        )
    }
}

/// The llm-d shape: `groups` long system prompts, each request one of them plus a question of
/// its own.
pub fn shared_prefix_turn(
    rng: &mut ChaCha8Rng,
    group: u64,
    system: u32,
    question: u32,
    output: u32,
) -> Turn {
    let mut prompt = shared(99, 4, group, system);
    prompt.extend(fresh(rng, question));
    Turn {
        prompt,
        output,
        pause: 0.0,
    }
}

fn geometric(rng: &mut ChaCha8Rng, p: f64) -> u32 {
    let mut n = 0;
    while rng.random::<f64>() > p && n < 1_000 {
        n += 1;
    }
    n
}

/// An exponential draw of mean `mean`.
pub fn exp(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    -mean * u.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_replay_and_turns_extend_the_previous_prompt() {
        let mix = Mix::default();
        for n in 0..200 {
            let (kind, turns) = session(0, n, 7, &mix);
            let (_, again) = session(0, n, 7, &mix);
            assert_eq!(turns.len(), again.len());
            for (a, b) in turns.iter().zip(&again) {
                assert_eq!(a.prompt, b.prompt);
            }
            for pair in turns.windows(2) {
                assert!(pair[1].prompt.starts_with(&pair[0].prompt), "{kind:?}");
            }
            for t in &turns {
                assert!(t.prompt.len() as u32 + t.output <= mix.max_model_len);
            }
        }
    }

    #[test]
    fn sessions_of_one_app_share_its_system_prompt() {
        let mix = Mix {
            chat: 1.0,
            agent: 0.0,
            ..Mix::default()
        };
        let firsts: Vec<Vec<u32>> = (0..50)
            .map(|n| session(1, n, 3, &mix).1[0].prompt.clone())
            .collect();
        let sharing = firsts
            .iter()
            .filter(|p| firsts.iter().filter(|q| q[..600] == p[..600]).count() > 1)
            .count();
        assert!(sharing > 40, "{sharing} of 50 share a system prompt");
    }
}
