//! Arguments for a forced tool call: a JSON value that satisfies the function's `parameters`
//! schema, drawn from the request's seed.
//!
//! vLLM forces a named or required tool call through structured output, so the real engine's
//! arguments always parse and match the schema; the simulator keeps that promise for the
//! subset of JSON Schema clients put in tool definitions. Anything it does not understand
//! becomes `null`, and depth and sizes are bounded so no schema can make it loop or explode.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde_json::{Map, Number, Value};

/// Deepest nesting generated; below it every value is `null`.
const MAX_DEPTH: usize = 8;
/// Most values generated in all: arrays repeat their item schema, so without a total bound a
/// nested schema of modest size could ask for millions of values.
const MAX_VALUES: u32 = 2_000;
/// Most array items and most properties generated per object.
const MAX_ITEMS: u64 = 4;
const MAX_PROPERTIES: usize = 32;
/// Words strings are made of (short, ASCII, cheap in tokens).
const WORDS: &[&str] = &[
    "alpha", "bravo", "delta", "echo", "gamma", "kilo", "lima", "nova", "oscar", "sierra",
];

/// A value valid for `schema`, reproducible from `rng`'s state.
pub fn generate(schema: &Value, rng: &mut ChaCha8Rng) -> Value {
    let mut budget = MAX_VALUES;
    value(schema, rng, 0, &mut budget)
}

fn value(schema: &Value, rng: &mut ChaCha8Rng, depth: usize, budget: &mut u32) -> Value {
    if *budget == 0 {
        return Value::Null;
    }
    *budget -= 1;
    let Some(obj) = schema.as_object() else {
        // `true` or a missing schema allows anything: a string is the least surprising.
        return if schema.as_bool() == Some(false) || depth >= MAX_DEPTH {
            Value::Null
        } else {
            word(rng)
        };
    };
    if depth >= MAX_DEPTH {
        return Value::Null;
    }
    if let Some(c) = obj.get("const") {
        return c.clone();
    }
    if let Some(choices) = obj
        .get("enum")
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty())
    {
        return pick(choices, rng).clone();
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(alts) = obj
            .get(key)
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
        {
            return value(pick(alts, rng), rng, depth + 1, budget);
        }
    }
    if let Some([only]) = obj
        .get("allOf")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    {
        return value(only, rng, depth + 1, budget);
    }
    let kind = match obj.get("type") {
        Some(Value::String(t)) => Some(t.as_str()),
        Some(Value::Array(ts)) => {
            // A list of types: prefer a non-null one, as a model would.
            let real: Vec<&Value> = ts.iter().filter(|t| t.as_str() != Some("null")).collect();
            if real.is_empty() {
                ts.first().and_then(Value::as_str)
            } else {
                pick(&real, rng).as_str()
            }
        }
        _ if obj.contains_key("properties") => Some("object"),
        _ if obj.contains_key("items") => Some("array"),
        _ => None,
    };
    match kind {
        Some("object") => object(obj, rng, depth, budget),
        Some("array") => array(obj, rng, depth, budget),
        Some("string") => string(obj, rng),
        Some("integer") => integer(obj, rng),
        Some("number") => number(obj, rng),
        Some("boolean") => Value::Bool(rng.random_bool(0.5)),
        _ => Value::Null,
    }
}

fn pick<'a, T>(items: &'a [T], rng: &mut ChaCha8Rng) -> &'a T {
    &items[rng.random_range(0..items.len())]
}

fn word(rng: &mut ChaCha8Rng) -> Value {
    Value::String((*pick(WORDS, rng)).to_owned())
}

/// Every required property, and each optional one with even odds.
fn object(obj: &Map<String, Value>, rng: &mut ChaCha8Rng, depth: usize, budget: &mut u32) -> Value {
    let required: Vec<&str> = obj
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut out = Map::new();
    let Some(props) = obj.get("properties").and_then(Value::as_object) else {
        // Required names without definitions still have to be present.
        for name in required.into_iter().take(MAX_PROPERTIES) {
            out.insert(name.to_owned(), word(rng));
        }
        return Value::Object(out);
    };
    for (name, sub) in props.iter().take(MAX_PROPERTIES) {
        if required.contains(&name.as_str()) || rng.random_bool(0.5) {
            out.insert(name.clone(), value(sub, rng, depth + 1, budget));
        }
    }
    for name in required.into_iter().take(MAX_PROPERTIES) {
        if !out.contains_key(name) {
            out.insert(name.to_owned(), Value::Null);
        }
    }
    Value::Object(out)
}

fn array(obj: &Map<String, Value>, rng: &mut ChaCha8Rng, depth: usize, budget: &mut u32) -> Value {
    let min = obj.get("minItems").and_then(Value::as_u64).unwrap_or(1);
    let max = obj
        .get("maxItems")
        .and_then(Value::as_u64)
        .unwrap_or(min.max(3));
    let (lo, hi) = (
        min.min(MAX_ITEMS),
        max.min(MAX_ITEMS).max(min.min(MAX_ITEMS)),
    );
    let n = rng.random_range(lo..=hi);
    let items = obj.get("items").cloned().unwrap_or(Value::Bool(true));
    Value::Array(
        (0..n)
            .map(|_| value(&items, rng, depth + 1, budget))
            .collect(),
    )
}

fn string(obj: &Map<String, Value>, rng: &mut ChaCha8Rng) -> Value {
    let min = obj.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let max = obj.get("maxLength").and_then(Value::as_u64);
    let mut s = String::new();
    while (s.len() as u64) < min.clamp(1, 64) {
        if !s.is_empty() {
            s.push(' ');
        }
        let w: &&str = pick(WORDS, rng);
        s.push_str(w);
    }
    if let Some(max) = max {
        s.truncate(usize::try_from(max).unwrap_or(usize::MAX));
    }
    Value::String(s)
}

/// Bounds of a numeric schema as given (inclusive or exclusive).
fn bounds(obj: &Map<String, Value>) -> (Option<f64>, Option<f64>) {
    let get = |k: &str| obj.get(k).and_then(Value::as_f64).filter(|v| v.is_finite());
    (
        get("minimum").or(get("exclusiveMinimum")),
        get("maximum").or(get("exclusiveMaximum")),
    )
}

fn integer(obj: &Map<String, Value>, rng: &mut ChaCha8Rng) -> Value {
    const SPAN: i64 = 100;
    let (lo, hi) = bounds(obj);
    let ex_lo = obj.get("exclusiveMinimum").is_some_and(Value::is_number);
    let ex_hi = obj.get("exclusiveMaximum").is_some_and(Value::is_number);
    // Float bounds are clamped into i64's range before rounding inward.
    let lo = lo.map(|v| {
        let v = v.clamp(-9.0e18, 9.0e18);
        let c = v.ceil() as i64;
        if ex_lo && c as f64 == v { c + 1 } else { c }
    });
    let hi = hi.map(|v| {
        let v = v.clamp(-9.0e18, 9.0e18);
        let f = v.floor() as i64;
        if ex_hi && f as f64 == v { f - 1 } else { f }
    });
    let (lo, hi) = match (lo, hi) {
        (Some(l), Some(h)) => (l, h),
        (Some(l), None) => (l, l.saturating_add(SPAN)),
        (None, Some(h)) => (h.saturating_sub(SPAN), h),
        (None, None) => (0, SPAN),
    };
    if lo > hi {
        return Value::Null;
    }
    Value::Number(Number::from(rng.random_range(lo..=hi)))
}

fn number(obj: &Map<String, Value>, rng: &mut ChaCha8Rng) -> Value {
    let (lo, hi) = bounds(obj);
    let (lo, hi) = match (lo, hi) {
        (Some(l), Some(h)) => (l, h),
        (Some(l), None) => (l, l + 100.0),
        (None, Some(h)) => (h - 100.0, h),
        (None, None) => (0.0, 100.0),
    };
    if !(lo.is_finite() && hi.is_finite()) || lo > hi {
        return Value::Null;
    }
    // Two decimals, kept inside the bounds (exclusive ones are rarely hit exactly).
    let v = ((lo + (hi - lo) * rng.random::<f64>()) * 100.0).round() / 100.0;
    Number::from_f64(v.clamp(lo, hi)).map_or(Value::Null, Value::Number)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rand::SeedableRng;

    fn gen_with(schema: Value, seed: u64) -> Value {
        generate(&schema, &mut ChaCha8Rng::seed_from_u64(seed))
    }

    #[test]
    fn object_has_required_keys_with_typed_values() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "where": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}}, "required": ["lat"]}
            },
            "required": ["city", "unit", "days", "ok", "tags", "where"]
        });
        for seed in 0..50 {
            let v = gen_with(schema.clone(), seed);
            assert!(v["city"].is_string());
            assert!(["c", "f"].contains(&v["unit"].as_str().unwrap()));
            assert!((1..=7).contains(&v["days"].as_i64().unwrap()));
            assert!(v["ok"].is_boolean());
            assert!(v["tags"].as_array().unwrap().iter().all(Value::is_string));
            assert!(v["where"]["lat"].as_f64().unwrap().abs() <= 90.0);
        }
    }

    #[test]
    fn hostile_schemas_give_null_not_a_panic() {
        for s in [
            serde_json::json!({"type": "integer", "minimum": 5, "maximum": 1}),
            serde_json::json!({"type": "integer", "minimum": 1e300}),
            serde_json::json!({"type": "number", "minimum": f64::MAX}),
            serde_json::json!({"type": "array", "minItems": u64::MAX, "items": {"type": "array"}}),
            serde_json::json!({"enum": []}),
            serde_json::json!({"type": "array", "minItems": 4, "items": {"type": "array", "minItems": 4, "items": {"type": "array", "minItems": 4, "items": {"type": "array", "minItems": 4, "items": {"type": "array", "minItems": 4, "items": {"type": "array", "minItems": 4, "items": {"type": "array", "minItems": 4, "items": {"type": "string"}}}}}}}}),
            serde_json::json!("nonsense"),
            serde_json::json!({"type": "string", "maxLength": 0}),
        ] {
            let _ = gen_with(s, 1);
        }
    }
}
