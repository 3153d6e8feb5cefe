//! What an engine produces, as it travels from the node to the client: the engine's choice
//! delta kept as the bytes it sent (relayed into chat chunks without re-encoding), read once
//! on arrival for what the gateway itself needs (text for the stream bound and the retained
//! result, tool calls for the non-streamed message and the Generations API's events), and
//! checked there, because a node is not trusted to send well-formed output.

use std::fmt;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use crate::protocol::Api;

/// JSON kept as the bytes it arrived as.
#[derive(Clone)]
pub struct RawJson(Box<RawValue>);

impl RawJson {
    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// Encodes `value` (for the agent, which builds some deltas itself).
    pub fn from_value<T: Serialize>(value: &T) -> Option<Self> {
        serde_json::value::to_raw_value(value).ok().map(Self)
    }

    /// Parses `text` as one JSON value, keeping its bytes.
    pub fn parse(text: &str) -> Option<Self> {
        serde_json::from_str::<Box<RawValue>>(text).ok().map(Self)
    }

    fn is_null(&self) -> bool {
        self.get() == "null"
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Output text never reaches a log through a Debug impl: only its size.
        write!(f, "RawJson({} bytes)", self.get().len())
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Serialize for RawJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RawJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(d).map(Self)
    }
}

/// The `chunk` frame's `delta`: text in protocol 1, the engine's structured delta from
/// protocol 2 (an object: `content`, `tool_calls`, `reasoning_content`, … as the engine
/// wrote them; `text` for a legacy completion; `data` for embeddings).
#[derive(Debug, Clone, PartialEq)]
pub enum WireDelta {
    /// Protocol 1: incremental text.
    Text(String),
    /// Protocol 2: the engine's delta object, verbatim.
    Object(RawJson),
}

impl Serialize for WireDelta {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Text(t) => t.serialize(s),
            Self::Object(raw) => raw.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for WireDelta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawJson::deserialize(d)?;
        match raw.get().as_bytes().first() {
            Some(b'"') => serde_json::from_str(raw.get())
                .map(Self::Text)
                .map_err(D::Error::custom),
            Some(b'{') => Ok(Self::Object(raw)),
            _ => Err(D::Error::custom("delta must be a string or an object")),
        }
    }
}

/// One tool call fragment of a streamed delta (OpenAI's `choices[].delta.tool_calls[]`): the
/// first fragment of a call names it (`id`, `type`, `function.name`), the following ones
/// carry pieces of `function.arguments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// Which call of the message this fragment belongs to.
    pub index: u32,
    /// The call's id (first fragment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (first fragment).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name and argument fragment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<FunctionDelta>,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FunctionDelta {
    /// The function's name (first fragment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A piece of the JSON arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// The fields of a structured delta the gateway reads; every other field is relayed as is.
#[derive(Deserialize)]
struct Fields {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallDelta>>,
    #[serde(default)]
    data: Option<Vec<serde::de::IgnoredAny>>,
}

/// Most tool calls one message may make, and the index bound of a fragment.
pub const MAX_TOOL_CALLS: u32 = 128;

/// Why a node's delta was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadDelta {
    /// Not an object, or a known field of the wrong type.
    #[error("delta fields of the wrong type")]
    Shape,
    /// A tool call index beyond [`MAX_TOOL_CALLS`].
    #[error("tool call index out of range")]
    ToolIndex,
    /// `logprobs` that are neither null nor an object.
    #[error("logprobs of the wrong type")]
    Logprobs,
    /// JSON nested deeper than [`MAX_RELAYED_DEPTH`].
    #[error("nested too deep")]
    Depth,
    /// A `\u` escape of half a UTF-16 surrogate pair, without its other half.
    #[error("lone surrogate escape")]
    Surrogate,
}

/// How deep the JSON a node relays (a delta's unknown fields, its logprobs) may nest. An
/// engine's delta nests four or five levels (`tool_calls[].function`, `logprobs.content[]
/// .top_logprobs[]`); a client's JSON parser may recurse per level (serde_json's `Value`
/// stops at 128), so a node is not allowed to hand it more than 64.
pub const MAX_RELAYED_DEPTH: usize = 64;

/// Checks JSON text that is relayed to clients as its bytes: nested at most
/// [`MAX_RELAYED_DEPTH`], and every `\u` escape of a UTF-16 surrogate part of a pair (a lone
/// one is not a character; strict parsers refuse it). `text` must already be valid JSON: this
/// reads only what the parse that checked it let through unexamined. It walks the bytes once
/// without recursion, so no input can exhaust the stack.
pub fn check_relayed(text: &str) -> Result<(), BadDelta> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut in_string = false;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        i += 1;
        if !in_string {
            match b {
                b'{' | b'[' => {
                    depth += 1;
                    if depth > MAX_RELAYED_DEPTH {
                        return Err(BadDelta::Depth);
                    }
                }
                b'}' | b']' => depth = depth.saturating_sub(1),
                b'"' => in_string = true,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = false,
            b'\\' => {
                let escaped = bytes.get(i).copied();
                i += 1;
                if escaped != Some(b'u') {
                    continue;
                }
                let unit = hex4(bytes, i).ok_or(BadDelta::Shape)?;
                i += 4;
                match unit {
                    0xD800..=0xDBFF => {
                        let pair = bytes.get(i..i + 2) == Some(b"\\u".as_slice())
                            && hex4(bytes, i + 2)
                                .is_some_and(|low| (0xDC00..=0xDFFF).contains(&low));
                        if !pair {
                            return Err(BadDelta::Surrogate);
                        }
                        i += 6;
                    }
                    0xDC00..=0xDFFF => return Err(BadDelta::Surrogate),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The four hex digits at `at`, as a UTF-16 code unit.
fn hex4(bytes: &[u8], at: usize) -> Option<u16> {
    let digits = std::str::from_utf8(bytes.get(at..at + 4)?).ok()?;
    u16::from_str_radix(digits, 16).ok()
}

/// Slack every output bound allows beyond its per-unit figure: a first delta's `role`, a
/// finish, an engine's extra fields.
pub const OUTPUT_SLACK_BYTES: u64 = 64 << 10;

/// Bytes one token may take as a node sends it (the delta object around it, the token's text
/// JSON-escaped, a tool call fragment's `index`/`id`/`function`): an engine's delta for one
/// token is well under 100 bytes; no tokenizer has a token whose escaped text nears this.
pub const BYTES_PER_TOKEN: u64 = 1 << 10;

/// Bytes one logprob entry may take (`token`, `logprob`, `bytes`), per token and per
/// alternative asked for.
pub const BYTES_PER_LOGPROB: u64 = 512;

/// Alternatives per token counted at most (`top_logprobs`, a legacy `logprobs`): vLLM's
/// default `--max-logprobs`, OpenAI's limit.
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// Dimensions of an embedding counted per input when the model's are not configured
/// (`embedding_dimensions`): more than any served embedding model has (bge-m3 1,024, OpenAI's
/// largest 3,072, e5-mistral 4,096).
pub const EMBEDDING_DIMENSIONS: u64 = 8192;

/// Bytes one embedding value may take: a float as JSON (`-1.2345678901234567e-05,` is 24)
/// or in base64 (5.3 bytes).
pub const BYTES_PER_DIMENSION: u64 = 32;

/// Bytes around one embedding (`{"object":"embedding","index":…,"embedding":[…]}`).
pub const BYTES_PER_EMBEDDING: u64 = 256;

/// The most output, in bytes as they arrive from the node (each chunk's delta and logprobs,
/// [`Piece::size`]), that a request allows: past it the node sent more than an engine can
/// for this request, and the generation ends as a `completion_over_bound` violation before
/// anything more is held. `completion_tokens` and `prompt_tokens` are the request's billing
/// bounds ([`crate::ports::UsageBounds`]).
///
/// - Embeddings: `inputs × (BYTES_PER_EMBEDDING + dimensions × BYTES_PER_DIMENSION)
///   + OUTPUT_SLACK_BYTES`, where `dimensions` is the model's (`dimensions`, else
///   [`EMBEDDING_DIMENSIONS`]: about 256 KiB per input), or fewer when the request asks for
///   shorter vectors (its own `dimensions`).
/// - Chat and legacy completions: `tokens × per_token + OUTPUT_SLACK_BYTES`, where `tokens` is
///   `completion_tokens`, plus `prompt_tokens` when the engine is asked to send the prompt
///   back (`echo`, `prompt_logprobs`), and `per_token` is `BYTES_PER_TOKEN`, plus
///   `BYTES_PER_LOGPROB × (1 + top)` when logprobs are asked for (`top`: `top_logprobs`, or a
///   legacy integer `logprobs`, at most `MAX_TOP_LOGPROBS`).
pub fn output_bound(
    api: Api,
    body: &serde_json::Value,
    completion_tokens: u64,
    prompt_tokens: u64,
    dimensions: Option<u32>,
) -> u64 {
    if api == Api::Embeddings {
        let model = dimensions.map_or(EMBEDDING_DIMENSIONS, u64::from);
        let asked = body.get("dimensions").and_then(serde_json::Value::as_u64);
        let dimensions = asked.map_or(model, |a| a.min(model));
        let per_input = dimensions
            .saturating_mul(BYTES_PER_DIMENSION)
            .saturating_add(BYTES_PER_EMBEDDING);
        return embedding_inputs(body)
            .saturating_mul(per_input)
            .saturating_add(OUTPUT_SLACK_BYTES);
    }
    let field = |name: &str| body.get(name).filter(|v| !v.is_null());
    let echoes = field("echo").is_some_and(|v| v != &serde_json::Value::Bool(false))
        || field("prompt_logprobs").is_some();
    let tokens = if echoes {
        completion_tokens.saturating_add(prompt_tokens)
    } else {
        completion_tokens
    };
    let top = match field("logprobs") {
        // Chat: `logprobs: true` and `top_logprobs: N`.
        Some(serde_json::Value::Bool(true)) => Some(
            field("top_logprobs")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0),
        ),
        Some(serde_json::Value::Bool(false)) | None => None,
        // Legacy completions: `logprobs: N`; anything else an engine refuses, counted as
        // the most it could mean.
        Some(v) => Some(v.as_u64().unwrap_or(MAX_TOP_LOGPROBS)),
    };
    let per_token = match top.or(field("prompt_logprobs").map(|_| MAX_TOP_LOGPROBS)) {
        Some(top) => BYTES_PER_TOKEN + BYTES_PER_LOGPROB * (1 + top.min(MAX_TOP_LOGPROBS)),
        None => BYTES_PER_TOKEN,
    };
    tokens
        .saturating_mul(per_token)
        .saturating_add(OUTPUT_SLACK_BYTES)
}

/// How many embeddings an embeddings body asks for: one per string or token id list in
/// `input` (one for a single string or a single list of ids).
fn embedding_inputs(body: &serde_json::Value) -> u64 {
    match body.get("input") {
        Some(serde_json::Value::Array(items)) if items.iter().any(|i| !i.is_number()) => {
            u64::try_from(items.len()).unwrap_or(u64::MAX)
        }
        _ => 1,
    }
}

/// One piece of output, as the generation hands it to the response.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// Text: the delta's `content` (chat) or `text` (legacy completion).
    pub text: String,
    /// `reasoning_content`.
    pub reasoning: String,
    /// Tool call fragments.
    pub tool_calls: Vec<ToolCallDelta>,
    /// Whether this is an embeddings result (`data`).
    pub embeddings: bool,
    /// The engine's delta object verbatim (protocol 2); `None` for protocol 1's text.
    pub raw: Option<RawJson>,
    /// The engine's `logprobs` for this piece, verbatim.
    pub logprobs: Option<RawJson>,
}

impl Piece {
    /// Plain text (protocol 1, retained results, tests).
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            embeddings: false,
            raw: None,
            logprobs: None,
        }
    }

    /// Reads a node's `delta` and `logprobs`, refusing what no engine sends.
    pub fn from_wire(delta: WireDelta, logprobs: Option<RawJson>) -> Result<Self, BadDelta> {
        let logprobs = match logprobs {
            Some(l) if l.is_null() => None,
            Some(l) if l.get().starts_with('{') => {
                check_relayed(l.get())?;
                Some(l)
            }
            Some(_) => return Err(BadDelta::Logprobs),
            None => None,
        };
        let raw = match delta {
            WireDelta::Text(text) => {
                return Ok(Self {
                    logprobs,
                    ..Self::text(text)
                });
            }
            WireDelta::Object(raw) => raw,
        };
        check_relayed(raw.get())?;
        let fields: Fields = serde_json::from_str(raw.get()).map_err(|_| BadDelta::Shape)?;
        // A line break can only be whitespace between tokens here (inside a JSON string it is
        // escaped), but copied into an SSE `data:` field it would split the event over several
        // lines: it becomes a space.
        let raw = one_line(raw);
        let logprobs = logprobs.map(one_line);
        let tool_calls = fields.tool_calls.unwrap_or_default();
        if tool_calls.iter().any(|c| c.index >= MAX_TOOL_CALLS) {
            return Err(BadDelta::ToolIndex);
        }
        let mut text = fields.content.unwrap_or_default();
        if let Some(t) = fields.text {
            text.push_str(&t);
        }
        Ok(Self {
            text,
            reasoning: fields.reasoning_content.unwrap_or_default(),
            tool_calls,
            embeddings: fields.data.is_some(),
            raw: Some(raw),
            logprobs,
        })
    }

    /// Bytes this piece takes in a client's stream, for the stream's bound.
    pub fn size(&self) -> usize {
        match &self.raw {
            Some(raw) => raw.get().len() + self.logprobs.as_ref().map_or(0, |l| l.get().len()),
            None => self.text.len(),
        }
    }
}

/// `raw` with every CR and LF (whitespace between tokens) turned into a space.
fn one_line(raw: RawJson) -> RawJson {
    if !raw.get().contains(['\n', '\r']) {
        return raw;
    }
    let flat = raw.get().replace(['\n', '\r'], " ");
    RawJson::parse(&flat).unwrap_or(raw)
}

impl From<String> for Piece {
    fn from(text: String) -> Self {
        Self::text(text)
    }
}

impl From<&str> for Piece {
    fn from(text: &str) -> Self {
        Self::text(text)
    }
}

/// A tool call assembled from its fragments.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id.
    pub id: String,
    /// Always `function` today.
    #[serde(rename = "type")]
    pub kind: String,
    /// Name and whole arguments.
    pub function: Function,
}

/// The function of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Function {
    /// The function's name.
    pub name: String,
    /// The arguments, a JSON text as the model wrote it.
    pub arguments: String,
}

/// The JSON of [`Assembled::extra_json`].
#[derive(Debug, Default, Serialize, Deserialize)]
struct Extra {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    reasoning: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCall>,
}

/// A message assembled from pieces (a non-streamed answer, a retained result).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Assembled {
    /// All text.
    pub content: String,
    /// All reasoning.
    pub reasoning: String,
    /// Tool calls, by index.
    pub tool_calls: Vec<ToolCall>,
    /// The logprobs' arrays, appended per key in order of first appearance (`content` for
    /// chat; `tokens`, `token_logprobs`, … for a legacy completion).
    pub logprobs: Vec<(String, Vec<serde_json::Value>)>,
}

impl Assembled {
    /// Adds one piece.
    pub fn push(&mut self, piece: &Piece) {
        self.content.push_str(&piece.text);
        self.reasoning.push_str(&piece.reasoning);
        for fragment in &piece.tool_calls {
            let i = fragment.index as usize;
            if self.tool_calls.len() <= i {
                self.tool_calls.resize_with(i + 1, ToolCall::default);
            }
            let call = &mut self.tool_calls[i];
            if let Some(id) = &fragment.id {
                call.id.clone_from(id);
            }
            if let Some(kind) = &fragment.kind {
                call.kind.clone_from(kind);
            }
            if let Some(f) = &fragment.function {
                if let Some(name) = &f.name {
                    call.function.name.push_str(name);
                }
                if let Some(args) = &f.arguments {
                    call.function.arguments.push_str(args);
                }
            }
        }
        if let Some(l) = &piece.logprobs {
            // Chat's `{"content": [...]}` and a legacy completion's parallel arrays (`tokens`,
            // `token_logprobs`, `top_logprobs`, `text_offset`) alike: each array is appended.
            if let Ok(fields) =
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(l.get())
            {
                for (key, value) in fields {
                    let serde_json::Value::Array(items) = value else {
                        continue;
                    };
                    let at = match self.logprobs.iter().position(|(k, _)| *k == key) {
                        Some(i) => i,
                        None => {
                            self.logprobs.push((key, Vec::new()));
                            self.logprobs.len() - 1
                        }
                    };
                    self.logprobs[at].1.extend(items);
                }
            }
        }
    }

    /// The assembled `logprobs` object, `None` when the engine sent none.
    pub fn logprobs(&self) -> Option<serde_json::Value> {
        if self.logprobs.is_empty() {
            return None;
        }
        let map: serde_json::Map<String, serde_json::Value> = self
            .logprobs
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::Array(v.clone())))
            .collect();
        Some(serde_json::Value::Object(map))
    }

    /// What a retained result keeps beside its text (the record's `output_extra`): the
    /// reasoning and the tool calls as JSON, `None` when there are neither.
    pub fn extra_json(&self) -> Option<String> {
        if self.reasoning.is_empty() && self.tool_calls.is_empty() {
            return None;
        }
        let extra = Extra {
            reasoning: self.reasoning.clone(),
            tool_calls: self.tool_calls(),
        };
        serde_json::to_string(&extra).ok()
    }

    /// A retained result: its text and [`Assembled::extra_json`] (unreadable extra JSON, which
    /// only a damaged row holds, is left out).
    pub fn retained(text: &str, extra: Option<&str>) -> Self {
        let extra: Extra = extra
            .and_then(|e| serde_json::from_str(e).ok())
            .unwrap_or_default();
        Self {
            content: text.to_owned(),
            reasoning: extra.reasoning,
            tool_calls: extra.tool_calls,
            logprobs: Vec::new(),
        }
    }

    /// The whole answer as one piece (a replay streams it as one chunk).
    pub fn into_piece(self) -> Piece {
        let tool_calls = self
            .tool_calls()
            .into_iter()
            .enumerate()
            .map(|(i, c)| ToolCallDelta {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                id: Some(c.id),
                kind: Some(c.kind),
                function: Some(FunctionDelta {
                    name: Some(c.function.name),
                    arguments: Some(c.function.arguments),
                }),
            })
            .collect();
        Piece {
            text: self.content,
            reasoning: self.reasoning,
            tool_calls,
            embeddings: false,
            raw: None,
            logprobs: None,
        }
    }

    /// Tool calls with a `type` (`function` when the engine named none).
    pub fn tool_calls(&self) -> Vec<ToolCall> {
        self.tool_calls
            .iter()
            .cloned()
            .map(|mut c| {
                if c.kind.is_empty() {
                    c.kind = "function".into();
                }
                c
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn wire(json: &str) -> WireDelta {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn deltas_are_text_or_objects_and_objects_keep_their_bytes() {
        assert_eq!(wire(r#""hi""#), WireDelta::Text("hi".into()));
        let text = r#"{"content":"a\u00e9","x":[1, 2]}"#;
        let WireDelta::Object(raw) = wire(text) else {
            panic!("not an object")
        };
        assert_eq!(raw.get(), text);
        assert!(serde_json::from_str::<WireDelta>("[1]").is_err());
        assert!(serde_json::from_str::<WireDelta>("7").is_err());
        assert_eq!(
            serde_json::to_string(&WireDelta::Object(raw)).unwrap(),
            text
        );
    }

    #[test]
    fn a_piece_reads_what_the_gateway_needs_and_refuses_wrong_types() {
        let p = Piece::from_wire(
            wire(r#"{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]}"#),
            Some(RawJson::parse("null").unwrap()),
        )
        .unwrap();
        assert_eq!(p.tool_calls[0].id.as_deref(), Some("call_1"));
        assert_eq!(p.logprobs, None);
        for bad in [
            r#"{"content":5}"#,
            r#"{"tool_calls":{}}"#,
            r#"{"tool_calls":[{"index":-1}]}"#,
            r#"{"tool_calls":[{"index":4000000000}]}"#,
            r#"{"reasoning_content":[]}"#,
        ] {
            assert!(Piece::from_wire(wire(bad), None).is_err(), "{bad}");
        }
        assert_eq!(
            Piece::from_wire(wire("{}"), RawJson::parse("[1]")),
            Err(BadDelta::Logprobs)
        );
    }

    #[test]
    fn relayed_json_nested_too_deep_or_with_lone_surrogates_is_refused() {
        let nested = |depth: usize| {
            format!(
                r#"{{"content":"a","x":{}1{}}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            )
        };
        // The delta object itself is one level.
        assert!(Piece::from_wire(wire(&nested(MAX_RELAYED_DEPTH - 1)), None).is_ok());
        assert_eq!(
            Piece::from_wire(wire(&nested(MAX_RELAYED_DEPTH)), None),
            Err(BadDelta::Depth)
        );
        // 10^5 levels: refused without recursing (a RawValue lets any depth through).
        assert_eq!(
            Piece::from_wire(wire(&nested(100_000)), None),
            Err(BadDelta::Depth)
        );
        let deep_logprobs = RawJson::parse(&format!(
            r#"{{"content":{}0{}}}"#,
            "[".repeat(1000),
            "]".repeat(1000)
        ));
        assert_eq!(
            Piece::from_wire(wire("{}"), deep_logprobs),
            Err(BadDelta::Depth)
        );
        // Brackets inside strings are text, not nesting.
        let text = format!(r#"{{"content":"{}"}}"#, "[{".repeat(500));
        assert!(Piece::from_wire(wire(&text), None).is_ok());
        for lone in [
            r#"{"x":"\ud800"}"#,
            r#"{"x":"\ud800a"}"#,
            r#"{"x":"\udbff\u0041"}"#,
            r#"{"x":"\udc00"}"#,
            r#"{"x":"a\uDFFF"}"#,
            r#"{"\ud800":1}"#,
        ] {
            assert_eq!(
                Piece::from_wire(wire(lone), None),
                Err(BadDelta::Surrogate),
                "{lone}"
            );
        }
        assert_eq!(
            Piece::from_wire(
                wire("{}"),
                RawJson::parse(r#"{"content":[{"token":"\ud83d"}]}"#)
            ),
            Err(BadDelta::Surrogate)
        );
        for fine in [
            r#"{"x":"\ud83d\ude00"}"#,
            r#"{"x":"\\ud800"}"#,
            r#"{"x":"\u00e9\"\\"}"#,
            r#"{"content":"\uD83D\uDE00"}"#,
        ] {
            assert!(Piece::from_wire(wire(fine), None).is_ok(), "{fine}");
        }
    }

    #[test]
    fn the_output_bound_follows_the_request() {
        use serde_json::json;
        let slack = OUTPUT_SLACK_BYTES;
        let input = 256 + 8192 * 32;
        let embed = |body| output_bound(Api::Embeddings, &body, 0, 10, None);
        assert_eq!(embed(json!({"input": "a"})), input + slack);
        assert_eq!(embed(json!({"input": [1, 2, 3]})), input + slack);
        assert_eq!(embed(json!({"input": ["a", "b"]})), 2 * input + slack);
        assert_eq!(embed(json!({"input": [[1], [2], [3]]})), 3 * input + slack);
        // The model's own vector length, and a shorter one the request asks for.
        let bge = |body| output_bound(Api::Embeddings, &body, 0, 10, Some(1024));
        assert_eq!(
            bge(json!({"input": ["a", "b"]})),
            2 * (256 + 1024 * 32) + slack
        );
        assert_eq!(
            bge(json!({"input": "a", "dimensions": 256})),
            256 + 256 * 32 + slack
        );
        assert_eq!(
            bge(json!({"input": "a", "dimensions": 100_000})),
            256 + 1024 * 32 + slack,
            "never more than the model's"
        );
        let chat = |body| output_bound(Api::Chat, &body, 5, 100, None);
        assert_eq!(chat(json!({})), 5 * 1024 + slack);
        assert_eq!(chat(json!({"logprobs": false})), 5 * 1024 + slack);
        assert_eq!(
            chat(json!({"logprobs": true})),
            5 * (1024 + 512) + slack,
            "the chosen token's entry"
        );
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 5})),
            5 * (1024 + 512 * 6) + slack
        );
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 1_000_000})),
            5 * (1024 + 512 * 21) + slack,
            "alternatives counted up to 20"
        );
        assert_eq!(
            chat(json!({"echo": true})),
            105 * 1024 + slack,
            "the prompt sent back"
        );
        let legacy = |body| output_bound(Api::Completions, &body, 5, 100, None);
        assert_eq!(legacy(json!({"logprobs": 3})), 5 * (1024 + 512 * 4) + slack);
        assert_eq!(legacy(json!({"logprobs": null})), 5 * 1024 + slack);
        // Unbounded rows (before bounds existed) saturate instead of overflowing.
        assert_eq!(
            output_bound(Api::Chat, &json!({}), u64::MAX, 0, None),
            u64::MAX
        );
    }

    #[test]
    fn line_breaks_between_tokens_never_reach_an_sse_line() {
        let p = Piece::from_wire(
            wire("{\r\n  \"content\": \"a\\nb\"\n}"),
            RawJson::parse("{\n\"content\": []}"),
        )
        .unwrap();
        let raw = p.raw.unwrap();
        assert!(!raw.get().contains(['\n', '\r']), "{}", raw.get());
        assert_eq!(p.text, "a\nb", "the text keeps its own line break");
        assert!(!p.logprobs.unwrap().get().contains('\n'));
    }

    #[test]
    fn fragments_assemble_into_calls() {
        let mut a = Assembled::default();
        for d in [
            r#"{"role":"assistant","content":""}"#,
            r#"{"tool_calls":[{"index":0,"id":"c0","type":"function","function":{"name":"get_weather"}}]}"#,
            r#"{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}"#,
            r#"{"tool_calls":[{"index":1,"id":"c1","function":{"name":"g","arguments":"{}"}}]}"#,
            r#"{"tool_calls":[{"index":0,"function":{"arguments":"\"Oslo\"}"}}]}"#,
        ] {
            a.push(&Piece::from_wire(wire(d), None).unwrap());
        }
        let calls = a.tool_calls();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, r#"{"city":"Oslo"}"#);
        assert_eq!(calls[1].kind, "function");
        assert_eq!(a.content, "");
    }
}
