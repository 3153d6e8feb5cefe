//! Log-probabilities in vLLM 0.32's two shapes (tests/fixtures/vllm/chat_logprobs*,
//! completions*).
//!
//! vLLM keeps a token's logprobs as a dict whose first entry is the sampled token, followed by
//! the top-k in rank order (the sampled one not repeated). Chat shows the first `k` entries of
//! that dict as `top_logprobs`, so the sampled token always comes first and the list is not
//! sorted when it ranks below the top; completions show the whole dict (up to k+1 entries).

use serde_json::{Map, Value, json};

use super::tokenizer::{SimTokenizer, TokenLogprobs};

/// The dict vLLM builds: sampled first, then the ranked ones without it.
fn entries(lp: &TokenLogprobs) -> impl Iterator<Item = (u32, f32)> + '_ {
    std::iter::once((lp.id, lp.logprob)).chain(lp.top.iter().copied().filter(|(t, _)| *t != lp.id))
}

/// A logprob as Python prints a float32 widened to float64.
fn number(v: f32) -> Value {
    serde_json::Number::from_f64(f64::from(v)).map_or(Value::Null, Value::Number)
}

fn token_entry(tok: &SimTokenizer, id: u32, logprob: f32) -> Map<String, Value> {
    let text = tok.token_text(id);
    let mut m = Map::new();
    m.insert("token".into(), Value::String(text.clone()));
    m.insert("logprob".into(), number(logprob));
    m.insert("bytes".into(), json!(text.as_bytes()));
    m
}

/// One element of a chat choice's `logprobs.content`.
pub fn chat_entry(tok: &SimTokenizer, lp: &TokenLogprobs) -> Value {
    let k = lp.top.len();
    let mut m = token_entry(tok, lp.id, lp.logprob);
    let top: Vec<Value> = entries(lp)
        .take(k)
        .map(|(id, l)| Value::Object(token_entry(tok, id, l)))
        .collect();
    m.insert("top_logprobs".into(), Value::Array(top));
    Value::Object(m)
}

/// A chat choice's `logprobs` for these tokens.
pub fn chat(tok: &SimTokenizer, tokens: &[TokenLogprobs]) -> Value {
    json!({ "content": tokens.iter().map(|t| chat_entry(tok, t)).collect::<Vec<_>>() })
}

/// A completion choice's `logprobs` for these tokens; `offset` is the length, in characters,
/// of the text sent before them.
pub fn completion(tok: &SimTokenizer, tokens: &[TokenLogprobs], mut offset: usize) -> Value {
    let mut offsets = Vec::with_capacity(tokens.len());
    let mut values = Vec::with_capacity(tokens.len());
    let mut texts = Vec::with_capacity(tokens.len());
    let mut tops = Vec::with_capacity(tokens.len());
    for lp in tokens {
        let text = tok.token_text(lp.id);
        offsets.push(offset);
        offset += text.chars().count();
        values.push(number(lp.logprob));
        let top: Map<String, Value> = entries(lp)
            .map(|(id, l)| (tok.token_text(id), number(l)))
            .collect();
        tops.push(Value::Object(top));
        texts.push(text);
    }
    json!({
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": texts,
        "top_logprobs": tops,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sampled_comes_first_and_is_not_repeated() {
        let tok = SimTokenizer::load().unwrap();
        let lp = TokenLogprobs {
            id: 100,
            logprob: -2.0,
            top: vec![(200, -0.5), (100, -2.0)],
        };
        let e = chat_entry(&tok, &lp);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["logprob"], -2.0);
        assert_eq!(top[1]["logprob"], -0.5);
        let c = completion(&tok, &[lp], 0);
        assert_eq!(c["top_logprobs"][0].as_object().unwrap().len(), 2);
    }
}
