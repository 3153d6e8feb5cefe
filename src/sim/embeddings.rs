//! `POST /v1/embeddings` for the optional embedding model (`--embedding-model`), in the shape
//! vLLM 0.32 answers with `--runner pooling --convert embed` (tests/fixtures/vllm/embeddings_*).
//!
//! Vectors are unit length and derived from the input's tokens alone, so the same text always
//! embeds the same way. They skip the engine: pooling is one prefill, far below the chat
//! model's step times, and vLLM serves it from a separate process anyway.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use serde_json::{Value, json};

use super::SimError;
use super::completions::token_ids;
use super::generate;
use super::http::{ApiError, AppState};
use super::tokenizer::SimTokenizer;

/// Length of every vector (the hidden size of the model behind the captures).
pub const EMBEDDING_DIMS: usize = 256;
/// Most inputs in one request.
const MAX_INPUTS: usize = 2048;

#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Value,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<u64>,
}

fn route_not_found() -> Response {
    ApiError::route_not_found().into_response()
}

pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(model) = state.embedding_model.clone() else {
        return route_not_found();
    };
    match embed(&state, &model, &headers, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn embed(
    state: &Arc<AppState>,
    model: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let req: EmbeddingRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}"), None))?;
    if let Some(asked) = req.model.as_deref().filter(|m| *m != model) {
        if asked == state.model {
            // The chat model has no embeddings route in vLLM.
            return Ok(route_not_found());
        }
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            param: None,
            message: format!("The model `{asked}` does not exist."),
        });
    }
    if let Some(d) = req.dimensions {
        return Err(ApiError::bad_request(
            format!(
                "Model '{model}' does not support Matryoshka embeddings; dimensions must be unset (received dimensions={d})."
            ),
            None,
        ));
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(
                format!("Invalid encoding_format `{other}`: expected float or base64."),
                Some("encoding_format"),
            ));
        }
    };
    let inputs = inputs(req.input, state.tokenizer.vocab_size())?;
    let tok = state.tokenizer.clone();
    let max_len = state.max_model_len;
    let token_lists = tokio::task::spawn_blocking(move || tokenize_all(&tok, inputs))
        .await
        .map_err(|e| ApiError::from(SimError::Tokenizer(e.to_string())))??;
    let mut data = Vec::with_capacity(token_lists.len());
    let mut prompt_tokens: u64 = 0;
    for (index, ids) in token_lists.iter().enumerate() {
        let n = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        if n > max_len {
            return Err(ApiError::bad_request(
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you requested {n} tokens in the input for embedding generation. Please reduce the length of the input. (parameter=input_tokens, value={n})"
                ),
                Some("input_tokens"),
            ));
        }
        prompt_tokens += u64::from(n);
        let v = vector(ids);
        let embedding = if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
            Value::String(base64_encode(&bytes))
        } else {
            Value::Array(
                v.iter()
                    .map(|f| {
                        serde_json::Number::from_f64(f64::from(*f))
                            .map_or(Value::Null, Value::Number)
                    })
                    .collect(),
            )
        };
        data.push(json!({"index": index, "object": "embedding", "embedding": embedding}));
    }
    Ok(Json(json!({
        "id": generate::response_id("embd", headers),
        "object": "list",
        "created": generate::unix_now(),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": null,
            "completion_tokens_details": null
        }
    }))
    .into_response())
}

/// One input: text, or token ids taken as they are.
enum Input {
    Text(String),
    Ids(Vec<u32>),
}

fn inputs(input: Value, vocab: u32) -> Result<Vec<Input>, ApiError> {
    let empty = || ApiError::bad_request("The decoder prompt cannot be empty", None);
    let ids = |items: &[Value]| token_ids(items, vocab);
    let list = match input {
        Value::String(s) => vec![Input::Text(s)],
        Value::Array(items) if items.first().is_some_and(Value::is_number) => {
            vec![Input::Ids(ids(&items)?)]
        }
        Value::Array(items) => {
            if items.len() > MAX_INPUTS {
                return Err(ApiError::bad_request(
                    format!("At most {MAX_INPUTS} inputs per request."),
                    Some("input"),
                ));
            }
            items
                .into_iter()
                .map(|item| match item {
                    Value::String(s) => Ok(Input::Text(s)),
                    Value::Array(inner) => Ok(Input::Ids(ids(&inner)?)),
                    _ => Err(ApiError::bad_request(
                        "input must be a string, a list of strings, or token ids.",
                        Some("input"),
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        _ => {
            return Err(ApiError::bad_request(
                "input must be a string, a list of strings, or token ids.",
                Some("input"),
            ));
        }
    };
    let is_empty = |i: &Input| match i {
        Input::Text(s) => s.is_empty(),
        Input::Ids(v) => v.is_empty(),
    };
    if list.is_empty() || list.iter().any(is_empty) {
        return Err(empty());
    }
    Ok(list)
}

/// Token ids of each input; unlike a completion prompt, the captured pooling runner adds no
/// `<s>` to text (5 tokens for "Hello world").
fn tokenize_all(tok: &SimTokenizer, inputs: Vec<Input>) -> Result<Vec<Vec<u32>>, SimError> {
    inputs
        .into_iter()
        .map(|i| match i {
            Input::Ids(ids) => Ok(ids),
            Input::Text(t) => tok.encode(&t),
        })
        .collect()
}

/// A unit vector drawn from a hash of the tokens.
pub fn vector(ids: &[u32]) -> Vec<f32> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ids.hash(&mut h);
    let mut rng = ChaCha8Rng::seed_from_u64(h.finish());
    let mut v: Vec<f32> = (0..EMBEDDING_DIMS)
        .map(|_| (0..4).map(|_| rng.random::<f32>() - 0.5).sum())
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// Standard base64 with padding.
// TODO(base64 crate): replace with the `base64` crate once it is a dependency.
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (plain, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64_encode(plain.as_bytes()), enc);
        }
    }
}
