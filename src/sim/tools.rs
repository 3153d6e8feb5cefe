//! Forced tool calls (`tool_choice` naming a function, or `"required"`), as vLLM 0.32 answers
//! them (tests/fixtures/vllm/tools_*).
//!
//! vLLM forces the output through structured decoding: for a named function the model writes
//! the arguments object itself; for `"required"` it writes `[{"name": …, "parameters": …}]`
//! and the server streams only the parameters as argument fragments. The simulator scripts
//! that text (arguments drawn from the function's schema) and the engine emits it token by
//! token, so the argument tokens are completion tokens like any other, followed by an
//! end-of-sequence token.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

use super::schema;

/// How the request chose its tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forced {
    /// `{"type": "function", "function": {"name": …}}`: finishes with `stop`.
    Named,
    /// `"required"`: finishes with `tool_calls`.
    Required,
}

/// The call the simulated model will make.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    pub forced: Forced,
    /// `chatcmpl-tool-` and 16 hex digits, as vLLM's random ids.
    pub id: String,
    pub name: String,
    /// The arguments object, compact (what the engine writes and streams).
    pub arguments: String,
    /// The whole text the engine generates.
    pub script: String,
}

/// A validation failure, worded as vLLM words it: (message, param).
pub type Invalid = (String, &'static str);

fn invalid(message: &str, param: &'static str) -> Invalid {
    (format!("{message} (parameter={param})"), param)
}

/// Validates `tools` and `tool_choice` as vLLM's `check_tool_usage` does and, when a call is
/// forced, plans it. `"auto"`, `"none"` and an absent choice answer with text.
pub fn plan(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    seed: u64,
    id_source: u64,
) -> Result<Option<ToolPlan>, Invalid> {
    if tools.and_then(Value::as_array).is_some_and(Vec::is_empty) {
        return Err(invalid(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            "tools",
        ));
    }
    let choice = match tool_choice {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s == "none" => return Ok(None),
        Some(c) => c,
    };
    let tools = match tools {
        None | Some(Value::Null) => {
            return Err(invalid(
                "When using `tool_choice`, `tools` must be set.",
                "tool_choice",
            ));
        }
        Some(t) => t.as_array().map(Vec::as_slice).unwrap_or_default(),
    };
    let function_of = |t: &Value| t.get("function").cloned().unwrap_or(Value::Null);
    let name_of = |f: &Value| f.get("name").and_then(Value::as_str).map(str::to_owned);
    let (forced, function) = match choice {
        Value::String(s) if s == "auto" => return Ok(None),
        Value::String(s) if s == "required" => {
            // The model picks one of the tools; the seed decides which.
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x544F_4F4C);
            let Some(tool) = tools.get(rng.random_range(0..tools.len().max(1))) else {
                return Ok(None);
            };
            (Forced::Required, function_of(tool))
        }
        Value::Object(o) => {
            let usage =
                r#"Correct usage: `{"type": "function", "function": {"name": "my_function"}}`"#;
            let Some(function) = o.get("function").filter(|f| f.is_object()) else {
                return Err(invalid(
                    &format!("Invalid value for `function` in `tool_choice`! {usage}"),
                    "tool_choice.function",
                ));
            };
            let Some(name) = name_of(function).filter(|n| !n.is_empty()) else {
                return Err(invalid(
                    &format!("Expected a non-empty `name` in `function` in `tool_choice`! {usage}"),
                    "tool_choice.function.name",
                ));
            };
            let Some(tool) = tools
                .iter()
                .find(|t| name_of(&function_of(t)).as_deref() == Some(name.as_str()))
            else {
                return Err(invalid(
                    "The tool specified in `tool_choice` does not match any of the specified `tools`",
                    "tool_choice",
                ));
            };
            (Forced::Named, function_of(tool))
        }
        other => {
            return Err(invalid(
                &format!(
                    "Invalid value for `tool_choice`: {other}! Only named tools, \"none\", \"auto\" or \"required\" are supported."
                ),
                "tool_choice",
            ));
        }
    };
    let name = name_of(&function).unwrap_or_default();
    let parameters = function
        .get("parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x4152_4753);
    let mut args = schema::generate(&parameters, &mut rng);
    if !args.is_object() {
        // Arguments are always an object on the wire, whatever the schema says.
        args = json!({});
    }
    let arguments = args.to_string();
    let script = match forced {
        Forced::Named => arguments.clone(),
        Forced::Required => format!(
            "[{{\"name\":{},\"parameters\":{arguments}}}]",
            Value::String(name.clone())
        ),
    };
    Ok(Some(ToolPlan {
        forced,
        id: format!(
            "chatcmpl-tool-{:016x}",
            id_source.wrapping_mul(0xD6E8_FEB8_6659_FD93)
        ),
        name,
        arguments,
        script,
    }))
}

impl ToolPlan {
    /// Where the arguments sit in the generated text.
    fn arguments_span(&self) -> (usize, usize) {
        match self.forced {
            Forced::Named => (0, self.script.len()),
            Forced::Required => {
                let start = self.script.len() - self.arguments.len() - 2;
                (start, start + self.arguments.len())
            }
        }
    }

    /// `finish_reason` when the call completed: vLLM says `stop` for a named function and
    /// `tool_calls` for `"required"`.
    pub fn finish_reason(&self) -> &'static str {
        match self.forced {
            Forced::Named => "stop",
            Forced::Required => "tool_calls",
        }
    }

    /// `message.tool_calls` of a non-streamed answer, from the text generated so far. A
    /// `"required"` call cut short parses as nothing, and vLLM then sends no `tool_calls`
    /// key; its complete arguments are re-serialized by Python's `json.dumps`.
    pub fn message_tool_calls(&self, generated: &str) -> Option<Value> {
        let arguments = match self.forced {
            Forced::Named => generated.to_owned(),
            Forced::Required => {
                let parsed: Value = serde_json::from_str(generated).ok()?;
                python_dumps(parsed.get(0)?.get("parameters")?)
            }
        };
        Some(json!([{
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments}
        }]))
    }
}

/// Turns the engine's text deltas into vLLM's `delta.tool_calls` fragments.
#[derive(Debug)]
pub struct ToolStream {
    plan: ToolPlan,
    text: String,
    sent: usize,
    started: bool,
}

/// What one token becomes in a forced tool call's stream.
#[derive(Debug, PartialEq)]
pub enum ToolDelta {
    /// A chunk whose delta is `{"tool_calls": [...]}`.
    Fragment(Value),
    /// A chunk whose delta is `{}` (only as the finish chunk).
    Empty,
    /// No chunk at all.
    Nothing,
}

impl ToolStream {
    pub fn new(plan: ToolPlan) -> Self {
        Self {
            plan,
            text: String::new(),
            sent: 0,
            started: false,
        }
    }

    pub fn plan(&self) -> &ToolPlan {
        &self.plan
    }

    /// Feeds one token's text; `last` when the sequence ends with it.
    pub fn push(&mut self, delta: &str, last: bool) -> ToolDelta {
        self.text.push_str(delta);
        let (start, end) = self.plan.arguments_span();
        let visible_end = self.text.len().min(end);
        let new = if visible_end > start.max(self.sent) {
            let from = start.max(self.sent);
            self.sent = visible_end;
            self.text.get(from..visible_end).unwrap_or_default()
        } else {
            ""
        };
        if !self.started {
            if new.is_empty() {
                return if last {
                    ToolDelta::Empty
                } else {
                    ToolDelta::Nothing
                };
            }
            self.started = true;
            return ToolDelta::Fragment(json!([{
                "id": self.plan.id,
                "type": "function",
                "index": 0,
                "function": {"name": self.plan.name, "arguments": new}
            }]));
        }
        match self.plan.forced {
            // Every token of a named call is a chunk, the end-of-sequence one included.
            Forced::Named => {
                ToolDelta::Fragment(json!([{"index": 0, "function": {"arguments": new}}]))
            }
            Forced::Required if !new.is_empty() => ToolDelta::Fragment(
                json!([{"index": 0, "function": {"name": null, "arguments": new}}]),
            ),
            Forced::Required if last => ToolDelta::Empty,
            Forced::Required => ToolDelta::Nothing,
        }
    }
}

/// `json.dumps` with Python's defaults: `", "` and `": "` separators, non-ASCII escaped.
fn python_dumps(v: &Value) -> String {
    let mut out = String::new();
    write_py(v, &mut out);
    out
}

fn write_py(v: &Value, out: &mut String) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_str(k, out);
                out.push_str(": ");
                write_py(item, out);
            }
            out.push('}');
        }
        Value::String(s) => write_py_str(s, out),
        other => out.push_str(&other.to_string()),
    }
}

fn write_py_str(s: &str, out: &mut String) {
    let quoted = Value::String(s.to_owned()).to_string();
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"]}}}])
    }

    #[test]
    fn required_streams_only_the_parameters_then_an_empty_finish() {
        let plan = plan(Some(&tools()), Some(&json!("required")), 1, 1)
            .unwrap()
            .unwrap();
        let script = plan.script.clone();
        let mut s = ToolStream::new(plan.clone());
        let mut args = String::new();
        for (i, c) in script.char_indices() {
            if let ToolDelta::Fragment(f) = s.push(&c.to_string(), false) {
                args.push_str(f[0]["function"]["arguments"].as_str().unwrap());
                if i > 0 && args.len() > 1 {
                    assert!(f[0]["function"]["name"].is_null());
                }
            }
        }
        assert_eq!(args, plan.arguments);
        assert_eq!(s.push("", true), ToolDelta::Empty);
        assert_eq!(
            plan.message_tool_calls(&script).unwrap()[0]["function"]["arguments"],
            python_dumps(&serde_json::from_str(&plan.arguments).unwrap())
        );
    }

    #[test]
    fn python_dumps_matches_json_dumps() {
        let v = json!({"tz": "CET", "n": [1, 2.5, true, null], "é": "ü"});
        assert_eq!(
            python_dumps(&v),
            r#"{"tz": "CET", "n": [1, 2.5, true, null], "\u00e9": "\u00fc"}"#
        );
    }
}
