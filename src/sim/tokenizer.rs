//! The simulator's tokenizer, chat template and text generator.
//!
//! Prompt tokens are counted exactly: messages go through the model's chat template and a real
//! byte-level BPE (`assets/tokenizer.json`, made by `scripts/gen-tokenizer.py`, the same recipe
//! as the tiny model behind the vLLM captures). Output is sampled from the vocabulary with a
//! seeded RNG and detokenized incrementally, so split UTF-8 shows up as empty deltas, as in vLLM.

use std::sync::Arc;

use super::SimError;
pub use crate::tokens::ChatMessage;
use crate::tokens::{ChatTokenizer, TokenizerError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Ids below this are the special tokens (`<unk>`, `<s>`, `</s>`, role markers): never sampled.
const FIRST_TEXT_TOKEN: u32 = 7;
/// The end-of-sequence token `</s>`.
pub const EOS_TOKEN: u32 = 2;
/// vLLM's cap on `top_logprobs` / `logprobs` (`--max-logprobs` default).
pub const MAX_LOGPROBS: u32 = 20;

/// The built-in tokenizer and chat template (shared with the gateway's prompt counter), and
/// the per-token byte table used to detokenize output.
#[derive(Debug)]
pub struct SimTokenizer {
    chat: ChatTokenizer,
    /// The raw bytes each token id stands for (byte-level BPE), indexed by id.
    token_bytes: Vec<Vec<u8>>,
}

impl SimTokenizer {
    /// Loads the embedded tokenizer and chat template.
    pub fn load() -> Result<Arc<Self>, SimError> {
        let chat = ChatTokenizer::builtin().map_err(|e| SimError::Tokenizer(e.to_string()))?;
        let decoder = byte_decoder();
        let tokenizer = chat.tokenizer();
        let vocab = tokenizer.get_vocab_size(true);
        let mut token_bytes = Vec::with_capacity(vocab);
        for id in 0..vocab as u32 {
            let piece = tokenizer.id_to_token(id).unwrap_or_default();
            let bytes = if id < FIRST_TEXT_TOKEN {
                Vec::new()
            } else {
                piece.chars().filter_map(&decoder).collect()
            };
            token_bytes.push(bytes);
        }
        Ok(Arc::new(Self { chat, token_bytes }))
    }

    /// Renders the chat template with the generation prompt, as vLLM does for a chat request.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, SimError> {
        self.chat.render_chat(messages).map_err(|e| match e {
            TokenizerError::Template(m) => SimError::BadRequest(format!("chat template: {m}")),
            other => SimError::Tokenizer(other.to_string()),
        })
    }

    /// Token ids of a rendered prompt (special tokens in the text are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, SimError> {
        self.chat
            .encode(text)
            .map_err(|e| SimError::Tokenizer(e.to_string()))
    }

    /// Exact prompt token count of a chat request.
    pub fn count_chat(&self, messages: &[ChatMessage]) -> Result<u32, SimError> {
        let ids = self.encode(&self.render_chat(messages)?)?;
        Ok(u32::try_from(ids.len()).unwrap_or(u32::MAX))
    }

    /// The token's string form as the tokenizer stores it (for `/tokenize`).
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.chat.tokenizer().id_to_token(id)
    }

    /// A token as vLLM shows it in logprobs: its text decoded alone (bytes that are not UTF-8
    /// on their own become U+FFFD), special tokens by name.
    pub fn token_text(&self, id: u32) -> String {
        match self.token_bytes.get(id as usize) {
            Some(b) if !b.is_empty() => String::from_utf8_lossy(b).into_owned(),
            _ => self.token_str(id).unwrap_or_default(),
        }
    }

    pub fn vocab_size(&self) -> u32 {
        u32::try_from(self.token_bytes.len()).unwrap_or(u32::MAX)
    }
}

/// Inverse of GPT-2's byte-to-unicode table used by byte-level BPE: printable bytes map to
/// themselves, the other 68 bytes to U+0100 onwards, in order.
fn byte_decoder() -> impl Fn(char) -> Option<u8> {
    let mut table = [0u8; 324];
    let mut filled = [false; 324];
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256usize;
    for b in 0..=255u8 {
        let cp = if printable(b) {
            usize::from(b)
        } else {
            next += 1;
            next - 1
        };
        table[cp] = b;
        filled[cp] = true;
    }
    move |c: char| {
        let cp = c as usize;
        (cp < table.len() && filled[cp]).then(|| table[cp])
    }
}

/// How a sequence's text generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// A stop string matched; the output is cut before it.
    String(String),
}

/// Samples a sequence's tokens and turns them into text deltas, holding back bytes that do
/// not yet form UTF-8 and the tail that could still become a stop string.
#[derive(Debug)]
pub struct Generator {
    tok: Arc<SimTokenizer>,
    rng: ChaCha8Rng,
    pending: Vec<u8>,
    text: String,
    emitted: usize,
    stops: Vec<String>,
    holdback: usize,
    /// Tokens to emit instead of sampling (a forced tool call's arguments).
    script: Option<std::collections::VecDeque<u32>>,
    /// `k` and a sampler of log-probabilities, when the request asked for them; its own RNG,
    /// so asking for logprobs does not change the text.
    logprobs: Option<(u32, ChaCha8Rng)>,
    /// Log-probabilities of the token just emitted.
    last: Option<TokenLogprobs>,
}

/// One generated token's log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token sampled.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The `k` most likely tokens in rank order (the sampled one among them if it ranks so).
    pub top: Vec<(u32, f32)>,
}

impl Generator {
    /// A generator whose output depends only on `seed` and the stop strings.
    pub fn new(tok: Arc<SimTokenizer>, seed: u64, stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let holdback = stops.iter().map(|s| s.chars().count()).max().unwrap_or(1) - 1;
        Self {
            tok,
            rng: ChaCha8Rng::seed_from_u64(seed),
            pending: Vec::new(),
            text: String::new(),
            emitted: 0,
            stops,
            holdback,
            script: None,
            logprobs: None,
            last: None,
        }
    }

    /// A generator that emits exactly `ids`, then nothing more to say.
    pub fn scripted(tok: Arc<SimTokenizer>, seed: u64, ids: Vec<u32>) -> Self {
        let mut g = Self::new(tok, seed, Vec::new());
        g.script = Some(ids.into());
        g
    }

    /// Also report log-probabilities with the `k` most likely tokens.
    pub fn with_logprobs(mut self, k: u32, seed: u64) -> Self {
        self.logprobs = Some((
            k.min(MAX_LOGPROBS),
            ChaCha8Rng::seed_from_u64(seed ^ 0x4C4F_4750_524F_4253),
        ));
        self
    }

    /// The log-probabilities of the last token emitted, if asked for.
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.last.take()
    }

    /// Marks the end-of-sequence token as emitted (for its log-probabilities).
    pub fn emit_eos(&mut self) {
        self.last = self.draw_logprobs(EOS_TOKEN);
    }

    /// A plausible distribution around the sampled token: it ranks first most of the time,
    /// log-probabilities fall with rank, and the sampled one is the same number wherever it
    /// appears.
    fn draw_logprobs(&mut self, id: u32) -> Option<TokenLogprobs> {
        let vocab = self.tok.vocab_size().max(FIRST_TEXT_TOKEN + 2);
        let (k, rng) = self.logprobs.as_mut()?;
        let k = *k;
        let rank = match rng.random_range(0..100u32) {
            0..60 => 0,
            60..85 => 1,
            _ => rng.random_range(2..k.max(2) + 4),
        };
        let mut lp = -rng.random_range(0.001f32..1.5);
        let mut top = Vec::with_capacity(k as usize);
        let mut used = vec![id];
        let mut sampled = lp;
        for r in 0..=rank.max(k) {
            if r > 0 {
                lp -= rng.random_range(0.05f32..1.5);
            }
            let tid = if r == rank {
                sampled = lp;
                id
            } else {
                // Another token than every one named so far (probing a few steps at most:
                // ranks are few, the vocabulary is large).
                let mut t = rng.random_range(FIRST_TEXT_TOKEN..vocab);
                for _ in 0..vocab {
                    if !used.contains(&t) {
                        break;
                    }
                    t = if t + 1 >= vocab {
                        FIRST_TEXT_TOKEN
                    } else {
                        t + 1
                    };
                }
                used.push(t);
                t
            };
            if r < k {
                top.push((tid, lp));
            }
        }
        Some(TokenLogprobs {
            id,
            logprob: sampled,
            top,
        })
    }

    /// Samples the next token and returns the text that may be sent now, and the stop string
    /// if one matched (then the returned delta ends right before it).
    pub fn next_token(&mut self) -> (String, Option<Stop>) {
        let id = match self.script.as_mut() {
            Some(script) => script.pop_front().unwrap_or(EOS_TOKEN),
            None => self
                .rng
                .random_range(FIRST_TEXT_TOKEN..self.tok.vocab_size().max(FIRST_TEXT_TOKEN + 1)),
        };
        self.last = self.draw_logprobs(id);
        if let Some(bytes) = self.tok.token_bytes.get(id as usize) {
            self.pending.extend_from_slice(bytes);
        }
        let before = self.text.len();
        self.drain_utf8();
        if let Some((pos, stop)) = self.find_stop(before) {
            let delta = self
                .text
                .get(self.emitted..pos)
                .unwrap_or_default()
                .to_owned();
            self.text.truncate(pos);
            self.emitted = pos;
            return (delta, Some(Stop::String(stop)));
        }
        let safe = self.safe_end();
        let delta = self
            .text
            .get(self.emitted..safe)
            .unwrap_or_default()
            .to_owned();
        self.emitted = self.emitted.max(safe);
        (delta, None)
    }

    /// Everything not yet sent, for the last token of a sequence that ends without a stop.
    pub fn flush(&mut self) -> String {
        if !self.pending.is_empty() {
            let rest = String::from_utf8_lossy(&self.pending).into_owned();
            self.text.push_str(&rest);
            self.pending.clear();
        }
        let delta = self.text.get(self.emitted..).unwrap_or_default().to_owned();
        self.emitted = self.text.len();
        delta
    }

    /// Moves complete UTF-8 from `pending` into `text`; invalid bytes become U+FFFD and an
    /// incomplete tail stays pending.
    fn drain_utf8(&mut self) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.text.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&self.pending[..valid]) {
                        self.text.push_str(s);
                    }
                    match e.error_len() {
                        Some(bad) => {
                            self.text.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// The first stop string, in the request's order, that matches text added since
    /// `before` (vLLM checks them in order, so list order decides between two matches).
    fn find_stop(&self, before: usize) -> Option<(usize, String)> {
        self.stops.iter().find_map(|stop| {
            let mut from = before.saturating_sub(stop.len()).max(self.emitted);
            while !self.text.is_char_boundary(from) {
                from -= 1;
            }
            self.text[from..]
                .find(stop.as_str())
                .map(|off| (from + off, stop.clone()))
        })
    }

    /// End of the text that can be sent without risking a partial stop string.
    fn safe_end(&self) -> usize {
        if self.holdback == 0 {
            return self.text.len();
        }
        self.text
            .char_indices()
            .rev()
            .nth(self.holdback - 1)
            .map_or(self.emitted, |(i, _)| i)
            .max(self.emitted)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: serde_json::Value::String(content.into()),
        }
    }

    #[test]
    fn counts_like_the_real_engine_did_for_the_captured_requests() {
        let tok = SimTokenizer::load().unwrap();
        let two = [
            msg("system", "You are a test model."),
            msg("user", "Say hello in five words."),
        ];
        assert_eq!(
            tok.count_chat(&two).unwrap(),
            30,
            "stream_chat_usage capture: prompt_tokens 30"
        );
        let one = [msg("user", "Say hello in five words.")];
        assert_eq!(
            tok.count_chat(&one).unwrap(),
            18,
            "stream_chat_stop capture: prompt_tokens 18"
        );
    }

    #[test]
    fn byte_table_round_trips_text() {
        let tok = SimTokenizer::load().unwrap();
        let text = "héllo wörld — ✓ tabs\tand\nnewlines";
        let ids = tok.encode(text).unwrap();
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&i| tok.token_bytes[i as usize].iter().copied())
            .collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), text);
    }

    #[test]
    fn same_seed_same_text_and_deltas_concatenate() {
        let tok = SimTokenizer::load().unwrap();
        let run = |seed| {
            let mut g = Generator::new(tok.clone(), seed, vec![]);
            let mut out: Vec<String> = (0..50).map(|_| g.next_token().0).collect();
            out.push(g.flush());
            out
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn stop_string_cuts_output_before_it() {
        let tok = SimTokenizer::load().unwrap();
        let mut plain = Generator::new(tok.clone(), 1234, vec![]);
        let full: String =
            (0..40).map(|_| plain.next_token().0).collect::<String>() + &plain.flush();
        let stop = full.chars().skip(10).take(3).collect::<String>();
        let mut g = Generator::new(tok, 1234, vec![stop.clone()]);
        let mut out = String::new();
        let mut stopped = None;
        for _ in 0..40 {
            let (d, s) = g.next_token();
            out.push_str(&d);
            if s.is_some() {
                stopped = s;
                break;
            }
        }
        assert_eq!(stopped, Some(Stop::String(stop.clone())));
        let cut = full.find(&stop).unwrap();
        assert_eq!(out, full[..cut]);
    }
}
