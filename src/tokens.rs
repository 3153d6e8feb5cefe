//! Prompt tokens counted with a model's own tokenizer and chat template. The gateway counts
//! every prompt before admission (an over-long prompt is refused before it costs a GPU
//! anything, and a node's usage report is bounded by this count); the simulator counts with
//! the same code, so its figures are vLLM's.
//!
//! The built-in tokenizer is the byte-level BPE behind the captured vLLM model
//! (`sim/assets/tokenizer.json`, made by `scripts/gen-tokenizer.py`); a model may name its own
//! `tokenizer.json` and chat template in the configuration.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;
use switchyard_actors::model_queue::{MAX_BLOCKS, block_hashes};
use tokenizers::Tokenizer;

const BUILTIN_TOKENIZER: &[u8] = include_bytes!("sim/assets/tokenizer.json");
const BUILTIN_TEMPLATE: &str = include_str!("sim/assets/chat_template.jinja");
const BOS_TOKEN: &str = "<s>";

/// Failures of loading or running a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A configured file could not be read.
    #[error("reading {path}: {message}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// The tokenizer or template is not valid.
    #[error("loading the tokenizer: {0}")]
    Load(String),
    /// The chat template refused the messages (a client error).
    #[error("chat template: {0}")]
    Template(String),
    /// Encoding failed.
    #[error("encoding: {0}")]
    Encode(String),
}

impl TokenizerError {
    /// The failure's kind, for logs: the messages of `Template` and `Encode` come from the
    /// template engine and the tokenizer, which may quote the prompt.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Read { .. } => "read",
            Self::Load(_) => "load",
            Self::Template(_) => "template",
            Self::Encode(_) => "encode",
        }
    }
}

/// One chat message as OpenAI clients send it; `content` is a string or a list of parts.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`.
    pub role: String,
    /// Text, an array of `{type, text}` parts, or null.
    #[serde(default)]
    pub content: Value,
}

impl ChatMessage {
    /// The message's text: a string as is, text parts concatenated, anything else empty.
    pub fn text(&self) -> String {
        match &self.content {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect(),
            _ => String::new(),
        }
    }
}

/// A tokenizer with its chat template.
#[derive(Debug)]
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    env: minijinja::Environment<'static>,
    /// The longest token's text in bytes: a text of n bytes has at least n / this many
    /// tokens, which refuses a huge prompt without tokenizing it.
    max_token_bytes: u64,
}

impl ChatTokenizer {
    /// The built-in tokenizer and template.
    pub fn builtin() -> Result<Self, TokenizerError> {
        let tokenizer = Tokenizer::from_bytes(BUILTIN_TOKENIZER)
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        Self::with_template(tokenizer, BUILTIN_TEMPLATE.to_owned())
    }

    /// A `tokenizer.json` and, optionally, a Jinja chat template (the built-in one otherwise).
    pub fn from_files(tokenizer: &Path, template: Option<&Path>) -> Result<Self, TokenizerError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|e| TokenizerError::Read {
                path: p.display().to_string(),
                message: e.to_string(),
            })
        };
        let tokenizer = Tokenizer::from_bytes(read(tokenizer)?)
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        let template = match template {
            Some(p) => String::from_utf8(read(p)?)
                .map_err(|_| TokenizerError::Load("the chat template is not UTF-8".into()))?,
            None => BUILTIN_TEMPLATE.to_owned(),
        };
        Self::with_template(tokenizer, template)
    }

    fn with_template(tokenizer: Tokenizer, template: String) -> Result<Self, TokenizerError> {
        let mut env = minijinja::Environment::new();
        env.add_template_owned("chat", template)
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        // A token's stored text is never shorter than the text it stands for (byte-level
        // BPE maps each byte to one character of one or two bytes; SentencePiece writes a
        // space as three).
        let max_token_bytes = tokenizer
            .get_vocab(true)
            .keys()
            .map(|t| t.len() as u64)
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Self {
            tokenizer,
            env,
            max_token_bytes,
        })
    }

    /// The underlying tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Renders the chat template with the generation prompt, as vLLM does for a chat request.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        let msgs: Vec<_> = messages
            .iter()
            .map(|m| minijinja::context! { role => m.role.as_str(), content => m.text() })
            .collect();
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => msgs,
            bos_token => BOS_TOKEN,
            add_generation_prompt => true,
        })
        .map_err(|e| TokenizerError::Template(e.to_string()))
    }

    /// Token ids of a text (special tokens in it are recognised). Offsets are never needed,
    /// so they are not tracked (`encode_fast`: the same ids, less work per token).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Exact prompt tokens of a chat request's messages through the template.
    pub fn count_chat(&self, messages: &[ChatMessage]) -> Result<u64, TokenizerError> {
        Ok(self.chat_ids(messages)?.len() as u64)
    }

    /// Token ids of a chat request's messages through the template.
    pub fn chat_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        self.encode(&self.render_chat(messages)?)
    }

    /// Tokens of a plain text.
    pub fn count_text(&self, text: &str) -> Result<u64, TokenizerError> {
        Ok(self.encode(text)?.len() as u64)
    }
}

/// What the gateway counted of one chat request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptCount {
    /// `messages` is only a lower bound, already at or past the limit the caller gave: the
    /// text was too long to be worth tokenizing.
    pub at_least: bool,
    /// The messages through the model's chat template: what the engine counts for a plain
    /// chat request.
    pub messages: u64,
    /// Tokens of what a template may also render into the prompt (tool definitions, tool
    /// calls and ids in messages, other non-text content): part of the bound on what an
    /// engine may report, not of the admission check.
    pub extra: u64,
    /// The largest single input (an embeddings request's inputs are each held to the
    /// context; a chat or completion prompt is one input: `messages`).
    pub largest: u64,
    /// The hash chain of a chat prompt's full KV blocks, as its engine names them (empty
    /// when not tokenized, or for other prompts): what routing matches against each node's
    /// cache.
    pub blocks: Vec<u64>,
}

/// The tokenizer of every configured model.
#[derive(Debug, Clone)]
pub struct PromptCounter {
    by_model: BTreeMap<String, Arc<ChatTokenizer>>,
}

impl PromptCounter {
    /// Loads each model's tokenizer (`None` as the path: the built-in one, loaded once).
    pub fn load<'a>(
        models: impl IntoIterator<Item = (&'a str, Option<&'a Path>, Option<&'a Path>)>,
    ) -> Result<Self, TokenizerError> {
        let mut builtin: Option<Arc<ChatTokenizer>> = None;
        let mut by_model = BTreeMap::new();
        for (name, tokenizer, template) in models {
            let tok = match tokenizer {
                Some(path) => Arc::new(ChatTokenizer::from_files(path, template)?),
                None => match &builtin {
                    Some(b) => b.clone(),
                    None => {
                        let b = Arc::new(ChatTokenizer::builtin()?);
                        builtin = Some(b.clone());
                        b
                    }
                },
            };
            by_model.insert(name.to_owned(), tok);
        }
        Ok(Self { by_model })
    }

    /// Counts a chat body's prompt for `model` on the blocking pool (tokenizing is CPU work),
    /// and hashes its full blocks of `block_size` tokens for routing (none with 0).
    /// A prompt whose text alone must hold `limit` tokens or more is not tokenized: its
    /// lower bound comes back, marked `at_least`. `None` when the model has no tokenizer.
    pub async fn count_chat(
        &self,
        model: &str,
        body: &serde_json::Map<String, Value>,
        limit: u64,
        block_size: u32,
    ) -> Option<Result<PromptCount, TokenizerError>> {
        let tok = self.by_model.get(model)?.clone();
        let messages = body.get("messages").cloned().unwrap_or(Value::Null);
        let text_bytes: u64 = messages
            .as_array()
            .map(|ms| {
                ms.iter()
                    .map(|m| content_bytes(m.get("content")))
                    .sum::<u64>()
            })
            .unwrap_or(0);
        let at_least = text_bytes / tok.max_token_bytes;
        if at_least >= limit {
            return Some(Ok(PromptCount {
                at_least: true,
                messages: at_least,
                extra: 0,
                largest: at_least,
                blocks: Vec::new(),
            }));
        }
        // Only what the template may render travels to the blocking pool.
        let extra: serde_json::Map<String, Value> = EXTRA_FIELDS
            .iter()
            .filter_map(|f| body.get(*f).map(|v| ((*f).to_owned(), v.clone())))
            .collect();
        let counted = tokio::task::spawn_blocking(move || {
            let parsed: Vec<ChatMessage> = messages
                .as_array()
                .map(|ms| {
                    ms.iter()
                        .filter_map(|m| ChatMessage::deserialize(m).ok())
                        .collect()
                })
                .unwrap_or_default();
            let extra_text = extra_prompt_text(&extra, &messages);
            let ids = tok.chat_ids(&parsed)?;
            let counted = ids.len() as u64;
            let blocks = if block_size == 0 {
                Vec::new()
            } else {
                let routed = ids.len().min(MAX_BLOCKS * block_size as usize);
                block_hashes(&ids[..routed], block_size)
            };
            Ok(PromptCount {
                at_least: false,
                messages: counted,
                largest: counted,
                blocks,
                extra: if extra_text.is_empty() {
                    0
                } else {
                    tok.count_text(&extra_text)?
                },
            })
        })
        .await;
        Some(counted.unwrap_or_else(|e| Err(TokenizerError::Encode(e.to_string()))))
    }
}

impl PromptCounter {
    /// Counts plain texts (a legacy completion's prompt, an embeddings request's inputs) for
    /// `model`, plus inputs the client tokenized itself (`token_lists`, their lengths), with
    /// the same bound as [`PromptCounter::count_chat`]: an input that must hold `limit` tokens
    /// or more is not tokenized (with `each`, every input is held to the limit on its own;
    /// otherwise their sum is).
    pub async fn count_texts(
        &self,
        model: &str,
        texts: Vec<String>,
        token_lists: Vec<u64>,
        limit: u64,
        each: bool,
    ) -> Option<Result<PromptCount, TokenizerError>> {
        let tok = self.by_model.get(model)?.clone();
        let floors = texts
            .iter()
            .map(|t| t.len() as u64 / tok.max_token_bytes)
            .chain(token_lists.iter().copied());
        let at_least = if each {
            floors.max().unwrap_or(0)
        } else {
            floors.fold(0u64, u64::saturating_add)
        };
        if at_least >= limit {
            return Some(Ok(PromptCount {
                at_least: true,
                messages: at_least,
                extra: 0,
                largest: at_least,
                blocks: Vec::new(),
            }));
        }
        // Engines may add special tokens to each input (BOS; an embedding model's CLS and
        // SEP): part of the bound on what a node may bill, not of the estimate.
        let inputs = (texts.len() + token_lists.len()) as u64;
        let specials = inputs.saturating_add(1).saturating_mul(2);
        let counted = tokio::task::spawn_blocking(move || {
            let mut total: u64 = token_lists.iter().copied().fold(0, u64::saturating_add);
            let mut largest = token_lists.iter().copied().max().unwrap_or(0);
            for t in &texts {
                let n = tok.count_text(t)?;
                total = total.saturating_add(n);
                largest = largest.max(n);
            }
            Ok(PromptCount {
                at_least: false,
                messages: total,
                extra: specials,
                largest,
                blocks: Vec::new(),
            })
        })
        .await;
        Some(counted.unwrap_or_else(|e| Err(TokenizerError::Encode(e.to_string()))))
    }
}

/// Body fields besides `messages` that a chat template may render into the prompt.
const EXTRA_FIELDS: [&str; 4] = ["tools", "functions", "tool_choice", "response_format"];

/// Bytes of a message's text: a string, or the `text` of its parts.
fn content_bytes(content: Option<&Value>) -> u64 {
    match content {
        Some(Value::String(s)) => s.len() as u64,
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| t.len() as u64)
            .sum(),
        _ => 0,
    }
}

/// The JSON of everything besides message text that a chat template may render into the
/// prompt: `tools`, `functions`, and each message's fields other than `role` and text content.
fn extra_prompt_text(extra: &serde_json::Map<String, Value>, messages: &Value) -> String {
    let mut out = String::new();
    for field in EXTRA_FIELDS {
        if let Some(v) = extra.get(field).filter(|v| !v.is_null()) {
            out.push_str(&v.to_string());
        }
    }
    if let Some(messages) = messages.as_array() {
        for m in messages.iter().filter_map(Value::as_object) {
            for (k, v) in m {
                let text_content = k == "content" && matches!(v, Value::String(_) | Value::Null);
                if k != "role" && !text_content && !v.is_null() {
                    out.push_str(&v.to_string());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn counts_the_captured_request_as_vllm_did() {
        // tests/fixtures/vllm/chat_nonstream.request.json: vLLM counted 30 prompt tokens.
        let body: Value = serde_json::from_str(include_str!(
            "../tests/fixtures/vllm/chat_nonstream.request.json"
        ))
        .unwrap();
        let tok = ChatTokenizer::builtin().unwrap();
        let messages: Vec<ChatMessage> = serde_json::from_value(body["messages"].clone()).unwrap();
        assert_eq!(tok.count_chat(&messages).unwrap(), 30);
    }

    #[tokio::test]
    async fn tools_and_tool_calls_count_as_extra() {
        let counter = PromptCounter::load([("m", None, None)]).unwrap();
        let plain = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
        let with_tools = serde_json::json!({
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": null,
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        });
        let a = counter
            .count_chat("m", plain.as_object().unwrap(), 8192, 16)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(a.extra, 0);
        let b = counter
            .count_chat("m", with_tools.as_object().unwrap(), 8192, 16)
            .await
            .unwrap()
            .unwrap();
        assert!(b.extra > 10, "{b:?}");
        assert!(
            counter
                .count_chat("other", plain.as_object().unwrap(), 8192, 16)
                .await
                .is_none()
        );
        assert!(!a.at_least);
        // A megabyte of text is refused by its size alone.
        let huge =
            serde_json::json!({"messages": [{"role": "user", "content": "word ".repeat(200_000)}]});
        let c = counter
            .count_chat("m", huge.as_object().unwrap(), 8192, 16)
            .await
            .unwrap()
            .unwrap();
        assert!(c.at_least && c.messages >= 8192, "{c:?}");
    }
}
