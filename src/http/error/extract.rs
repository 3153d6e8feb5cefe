//! The body, query and path extractors: every rejection of a body, a query string or a path
//! parameter is an [`ApiError`] whose message and `error.param` name the field (or the
//! position) it is about, and never carries a parser's internals.

use std::any::Any;

use axum::body::Bytes;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequest, FromRequestParts, RawPathParams, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::value::StrDeserializer;
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor,
};
use serde_json::map::Entry;
use serde_json::{Map, Number, Value};
use switchyard_actors::error::ErrorCode;

use super::ApiError;

/// Longest piece of client text (a key, a field name, a serde message) echoed in an error.
const ECHO_CHARS: usize = 64;
/// Longest parser message echoed in an error.
const MESSAGE_CHARS: usize = 200;

/// A JSON request body, parsed strictly and once: a key repeated in any object, at any depth,
/// is refused (JSON leaves the meaning open and parsers disagree on which copy wins, so a
/// proxy and the gateway could read two different requests); object key order is kept. A
/// rejection is 400 `invalid_request` (413 `request_too_large` over the body limit) whose
/// message and `error.param` name the key or the position. A typed `T` must be a JSON object
/// at the top; a `Value` may be anything.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T, S> FromRequest<S> for Json<T>
where
    T: DeserializeOwned + 'static,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !json_content_type(req.headers()) {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "Send the body as JSON, with `Content-Type: application/json`.",
            ));
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large()
            } else {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    "The request body could not be read.",
                )
            }
        })?;
        Self::from_bytes(&bytes)
    }
}

impl<T: DeserializeOwned + 'static> Json<T> {
    /// Parses `bytes` exactly as the extractor parses a request body.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ApiError> {
        let value: Box<dyn Any> = Box::new(parse_strict(bytes)?);
        // A handler that takes a `Value` gets the parsed tree itself: converting it again
        // would walk (and rehash) a chat body of up to a MiB for nothing.
        match value.downcast::<T>() {
            Ok(same) => Ok(Json(*same)),
            Err(value) => match value.downcast::<Value>() {
                Ok(value) => match *value {
                    Value::Object(fields) => from_fields(fields).map(Json),
                    _ => Err(ApiError::new(
                        ErrorCode::InvalidRequest,
                        "The body must be a JSON object.",
                    )),
                },
                // Unreachable: the box was made from a `Value` two lines up.
                Err(_) => Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    "The request body could not be read.",
                )),
            },
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return too_large();
        }
        ApiError::new(ErrorCode::InvalidRequest, rejection.body_text())
    }
}

fn too_large() -> ApiError {
    ApiError::new(ErrorCode::RequestTooLarge, "The request body is too large.")
}

/// `application/json`, or any `application/…+json`, with or without parameters (what
/// `axum::Json` accepts).
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.len() > "+json".len() && sub.ends_with("+json"))
}

/// A query string, read like a [`Json`] body's fields: a field given twice is refused (which
/// copy wins differs between proxies and frameworks), values arrive as strings, and a
/// rejection is 400 `invalid_request` whose `error.param` names the field.
#[derive(Debug, Clone, Copy, Default)]
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        // Percent-decoded pairs in order; decoding is lenient (bad UTF-8 becomes U+FFFD), so
        // this does not fail on real input.
        let axum::extract::Query(pairs) =
            axum::extract::Query::<Vec<(String, String)>>::try_from_uri(&parts.uri).map_err(
                |_| {
                    ApiError::new(
                        ErrorCode::InvalidRequest,
                        "The query string could not be read.",
                    )
                },
            )?;
        let mut fields = Map::new();
        for (key, value) in pairs {
            match fields.entry(key) {
                Entry::Occupied(seen) => {
                    let name = printable(seen.key(), ECHO_CHARS);
                    return Err(ApiError::new(
                        ErrorCode::InvalidRequest,
                        format!("`{name}` is given more than once in the query string."),
                    )
                    .with_param(name));
                }
                Entry::Vacant(slot) => {
                    slot.insert(Value::String(value));
                }
            }
        }
        from_fields(fields).map(Query)
    }
}

/// Path parameters whose rejection (a non-numeric id, bad UTF-8) is 400 `invalid_request`
/// naming the parameter, instead of axum's plain-text answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(rejection) => {
                // A single-value `Path` reports no key: the route's own names supply it.
                let names: Vec<String> = RawPathParams::from_request_parts(parts, state)
                    .await
                    .map(|raw| raw.iter().map(|(name, _)| name.to_owned()).collect())
                    .unwrap_or_default();
                Err(path_rejection(&rejection, &names))
            }
        }
    }
}

fn path_rejection(rejection: &PathRejection, names: &[String]) -> ApiError {
    use axum::extract::path::ErrorKind;
    let unreadable = || ApiError::new(ErrorCode::InvalidRequest, "The path could not be read.");
    let PathRejection::FailedToDeserializePathParams(e) = rejection else {
        return unreadable();
    };
    let (name, expected) = match e.kind() {
        ErrorKind::ParseErrorAtKey {
            key, expected_type, ..
        } => (Some(key.as_str()), describe_type(expected_type)),
        ErrorKind::ParseError { expected_type, .. } => (
            names.first().map(String::as_str),
            describe_type(expected_type),
        ),
        ErrorKind::ParseErrorAtIndex {
            index,
            expected_type,
            ..
        } => (
            names.get(*index).map(String::as_str),
            describe_type(expected_type),
        ),
        ErrorKind::InvalidUtf8InPathParam { key } => (Some(key.as_str()), "valid UTF-8"),
        ErrorKind::DeserializeError { key, .. } => (Some(key.as_str()), "a valid value"),
        _ => return unreadable(),
    };
    match name {
        Some(name) => {
            let name = printable(name, ECHO_CHARS);
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("The path parameter `{name}` must be {expected}."),
            )
            .with_param(name)
        }
        None => ApiError::new(
            ErrorCode::InvalidRequest,
            format!("A path parameter must be {expected}."),
        ),
    }
}

/// A Rust type name as a client reads it.
fn describe_type(name: &str) -> &'static str {
    match name {
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" | "u8" | "u16" | "u32" | "u64" | "u128"
        | "usize" => "an integer",
        "f32" | "f64" => "a number",
        "bool" => "`true` or `false`",
        _ => "a valid value",
    }
}

/// `s` with control characters escaped, cut to `max` characters: client text is echoed in
/// messages and must neither break a log line nor make an answer huge.
pub(crate) fn printable(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max + 8));
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Strict parsing: a `Value` built in one pass by a visitor that refuses a repeated key.

/// One step of the path to a repeated key: an object key or an array index.
#[derive(Debug)]
enum Segment {
    Key(String),
    Index(usize),
}

/// Parses a body into a [`Value`] in one pass, refusing a key repeated in any object.
fn parse_strict(bytes: &[u8]) -> Result<Value, ApiError> {
    let mut repeated: Option<Vec<Segment>> = None;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = StrictValue {
        repeated: &mut repeated,
    }
    .deserialize(&mut de)
    .and_then(|value| de.end().map(|()| value));
    match (parsed, repeated) {
        (Ok(value), _) => Ok(value),
        (Err(_), Some(path)) => Err(repeated_key(path)),
        (Err(e), None) => Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!(
                "The body is not valid JSON: {}.",
                printable(&e.to_string(), MESSAGE_CHARS)
            ),
        )),
    }
}

/// The refusal of a repeated key; `path` runs from the key outwards, as it was unwound.
fn repeated_key(mut path: Vec<Segment>) -> ApiError {
    path.reverse();
    let mut name = String::new();
    for segment in &path {
        match segment {
            Segment::Key(key) if name.is_empty() => name.push_str(key),
            Segment::Key(key) => {
                name.push('.');
                name.push_str(key);
            }
            Segment::Index(i) => {
                name.push('[');
                name.push_str(&i.to_string());
                name.push(']');
            }
        }
    }
    let name = printable(&name, ECHO_CHARS);
    ApiError::new(
        ErrorCode::InvalidRequest,
        format!("Duplicate key `{name}` in the JSON body: a key may appear once per object."),
    )
    .with_param(name)
}

/// Builds a [`Value`] from any JSON, refusing a repeated key. On that refusal it records the
/// key's path in `repeated` (each enclosing level adds its step as the error unwinds), since
/// the parser's own error can only carry a message.
struct StrictValue<'a> {
    repeated: &'a mut Option<Vec<Segment>>,
}

impl<'de> DeserializeSeed<'de> for StrictValue<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        // As serde_json's own `Value` does (JSON text cannot spell a non-finite number).
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let repeated = self.repeated;
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        loop {
            match seq.next_element_seed(StrictValue {
                repeated: &mut *repeated,
            }) {
                Ok(Some(item)) => items.push(item),
                Ok(None) => return Ok(Value::Array(items)),
                Err(e) => {
                    if let Some(path) = repeated.as_mut() {
                        path.push(Segment::Index(items.len()));
                    }
                    return Err(e);
                }
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let repeated = self.repeated;
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            // One hash per key: the entry both detects the repeat and takes the value.
            match map.entry(key) {
                Entry::Occupied(seen) => {
                    *repeated = Some(vec![Segment::Key(seen.key().clone())]);
                    return Err(de::Error::custom("duplicate key"));
                }
                Entry::Vacant(slot) => match access.next_value_seed(StrictValue {
                    repeated: &mut *repeated,
                }) {
                    Ok(value) => {
                        slot.insert(value);
                    }
                    Err(e) => {
                        if let Some(path) = repeated.as_mut() {
                            path.push(Segment::Key(slot.key().clone()));
                        }
                        return Err(e);
                    }
                },
            }
        }
        Ok(Value::Object(map))
    }
}

// ---------------------------------------------------------------------------------------
// Typed bodies: the top-level object is handed to `T` field by field, so a failure knows
// the field it was in (serde_json's own errors, from a `Value`, carry neither a path nor a
// position).

/// Deserializes `T` from a body's (or a query string's) top-level fields.
fn from_fields<T: DeserializeOwned>(fields: Map<String, Value>) -> Result<T, ApiError> {
    T::deserialize(Fields(fields)).map_err(|e| {
        let error = ApiError::new(ErrorCode::InvalidRequest, e.message);
        match e.param {
            Some(param) => error.with_param(param),
            None => error,
        }
    })
}

/// Why a typed body was refused, and the field it is about.
#[derive(Debug)]
struct FieldError {
    message: String,
    param: Option<String>,
}

impl FieldError {
    /// A value that did not fit its field.
    fn in_field(key: &str, cause: &serde_json::Error) -> Self {
        let name = printable(key, ECHO_CHARS);
        Self {
            message: format!(
                "Invalid `{name}`: {}.",
                printable(&cause.to_string(), MESSAGE_CHARS)
            ),
            param: Some(name),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FieldError {}

impl de::Error for FieldError {
    fn custom<M: std::fmt::Display>(msg: M) -> Self {
        Self {
            message: format!(
                "The body does not fit: {}.",
                printable(&msg.to_string(), MESSAGE_CHARS)
            ),
            param: None,
        }
    }

    fn missing_field(field: &'static str) -> Self {
        Self {
            message: format!("`{field}` is required."),
            param: Some(field.to_owned()),
        }
    }

    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        let name = printable(field, ECHO_CHARS);
        let known: Vec<String> = expected.iter().map(|f| format!("`{f}`")).collect();
        Self {
            message: format!(
                "Unknown field `{name}`; the fields are {}.",
                known.join(", ")
            ),
            param: Some(name),
        }
    }
}

/// The top-level fields of a body, as a deserializer whose map hands each value to
/// serde_json separately.
struct Fields(Map<String, Value>);

impl<'de> Deserializer<'de> for Fields {
    type Error = FieldError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, FieldError> {
        visitor.visit_map(FieldAccess {
            entries: self.0.into_iter(),
            current: None,
        })
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum
        identifier ignored_any
    }
}

struct FieldAccess {
    entries: serde_json::map::IntoIter,
    /// The entry whose key was just read; its value comes next.
    current: Option<(String, Value)>,
}

impl<'de> MapAccess<'de> for FieldAccess {
    type Error = FieldError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, FieldError> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        let field = seed.deserialize(StrDeserializer::<FieldError>::new(&key))?;
        self.current = Some((key, value));
        Ok(Some(field))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, FieldError> {
        let Some((key, value)) = self.current.take() else {
            return Err(de::Error::custom("a value was read before its key"));
        };
        seed.deserialize(value)
            .map_err(|e| FieldError::in_field(&key, &e))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::time::Instant;

    use axum::body::Body;
    use axum::http::HeaderValue;
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    fn refusal<T: DeserializeOwned + 'static + std::fmt::Debug>(body: &str) -> ApiError {
        Json::<T>::from_bytes(body.as_bytes()).unwrap_err()
    }

    fn said(e: &ApiError) -> (ErrorCode, &str, Option<&str>) {
        (
            e.failure.code,
            e.failure.message.as_str(),
            e.param.as_deref(),
        )
    }

    #[test]
    fn json_refuses_a_repeated_key_at_any_depth_and_names_it() {
        let e = refusal::<Value>(r#"{"model": "small", "messages": [], "model": "large"}"#);
        assert_eq!(
            said(&e),
            (
                ErrorCode::InvalidRequest,
                "Duplicate key `model` in the JSON body: a key may appear once per object.",
                Some("model")
            )
        );
        let e = refusal::<Value>(
            r#"{"messages": [{"role": "user"}, {"role": "user", "content": "a", "role": "x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("messages[1].role"));
        let e = refusal::<Value>(r#"[{"a": {"b": 1, "b": 2}}]"#);
        assert_eq!(e.param.as_deref(), Some("[0].a.b"));
        // The same key in sibling objects is fine.
        let ok = Json::<Value>::from_bytes(br#"[{"a": 1}, {"a": 2}]"#).unwrap();
        assert_eq!(ok.0, json!([{"a": 1}, {"a": 2}]));
    }

    #[test]
    fn json_echoes_keys_bounded_and_escaped() {
        let key = format!("a\\u0000{}", "k".repeat(10_000));
        let e = refusal::<Value>(&format!(r#"{{"{key}": 1, "{key}": 2}}"#));
        let param = e.param.unwrap();
        assert!(param.starts_with("a\\u{0}k"), "{param}");
        assert!(param.chars().count() <= ECHO_CHARS + 8, "{param}");
        assert!(e.failure.message.len() < 300);
    }

    #[test]
    fn json_keeps_key_order_and_numbers_as_serde_json_does() {
        let body =
            br#"{"z": 1, "a": -2, "m": 1.5, "big": 18446744073709551615, "n": null, "t": true}"#;
        let strict = Json::<Value>::from_bytes(body).unwrap().0;
        let plain: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(strict, plain);
        let keys: Vec<&String> = strict.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["z", "a", "m", "big", "n", "t"]);
    }

    #[test]
    fn json_syntax_errors_name_the_position() {
        for (body, position) in [
            ("", "line 1 column 0"),
            (r#"{"model": }"#, "line 1 column 11"),
            (r#"{"a": 1} x"#, "line 1 column 10"),
            ("{\n\"a\": 1,\n}", "line 3 column 1"),
        ] {
            let e = refusal::<Value>(body);
            assert_eq!(e.failure.code, ErrorCode::InvalidRequest);
            assert!(
                e.failure
                    .message
                    .starts_with("The body is not valid JSON: ")
                    && e.failure.message.contains(position),
                "{body:?}: {}",
                e.failure.message
            );
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(
            refusal::<Value>(&deep)
                .failure
                .message
                .contains("recursion limit")
        );
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Typed {
        name: String,
        #[serde(default)]
        count: Option<u32>,
    }

    #[test]
    fn typed_bodies_name_the_field_in_every_rejection() {
        let e = refusal::<Typed>(r#"{"name": "a", "count": "many"}"#);
        assert_eq!(e.param.as_deref(), Some("count"));
        assert!(
            e.failure
                .message
                .starts_with("Invalid `count`: invalid type: string")
        );
        let e = refusal::<Typed>(r#"{"name": "a", "colour": 1}"#);
        assert_eq!(e.param.as_deref(), Some("colour"));
        assert_eq!(
            e.failure.message,
            "Unknown field `colour`; the fields are `name`, `count`."
        );
        let e = refusal::<Typed>(r#"{"count": 1}"#);
        assert_eq!(
            (e.failure.message.as_str(), e.param.as_deref()),
            ("`name` is required.", Some("name"))
        );
        let e = refusal::<Typed>(r#"["a", 1]"#);
        assert_eq!(e.failure.message, "The body must be a JSON object.");
        let e = refusal::<Typed>(r#"{"name": "a", "name": "b"}"#);
        assert_eq!(e.param.as_deref(), Some("name"));
        let ok = Json::<Typed>::from_bytes(br#"{"name": "a", "count": null}"#).unwrap();
        assert_eq!((ok.0.name.as_str(), ok.0.count), ("a", None));
    }

    /// A chat body close to the 1 MiB limit: thousands of messages and a long content.
    fn large_chat_body() -> Vec<u8> {
        let messages: Vec<Value> = (0..4_000)
            .map(|i| {
                json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
                            "content": format!("message {i}: {}", "lorem ipsum ".repeat(18))})
            })
            .collect();
        let body = json!({"model": "small", "messages": messages, "max_tokens": 16,
                          "stream": true, "stream_options": {"include_usage": true}});
        serde_json::to_vec(&body).unwrap()
    }

    #[test]
    fn json_parses_a_large_body_once_and_about_as_fast_as_serde_json() {
        let body = large_chat_body();
        assert!(
            body.len() > 900 * 1024 && body.len() < 1024 * 1024,
            "{}",
            body.len()
        );
        let plain: Value = serde_json::from_slice(&body).unwrap();
        let strict = Json::<Value>::from_bytes(&body).unwrap().0;
        assert_eq!(strict, plain);

        // Best of a few runs each, so a busy machine does not decide the outcome.
        let best = |f: &dyn Fn()| {
            (0..5)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed()
                })
                .min()
                .unwrap()
        };
        let baseline = best(&|| {
            serde_json::from_slice::<Value>(&body).unwrap();
        });
        let ours = best(&|| {
            Json::<Value>::from_bytes(&body).unwrap();
        });
        assert!(
            ours <= baseline * 2 + std::time::Duration::from_millis(5),
            "strict {ours:?} vs serde_json {baseline:?}"
        );

        // A repeat in the very last message is still found, and named.
        let mut tail = body.clone();
        assert!(tail.ends_with(b"true}}"));
        tail.truncate(tail.len() - 1);
        tail.extend_from_slice(br#", "stream": false}"#);
        let e = Json::<Value>::from_bytes(&tail).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"));
    }

    #[test]
    fn json_wants_a_json_content_type() {
        let with = |ct: &str| {
            let mut h = axum::http::HeaderMap::new();
            h.insert(
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_str(ct).unwrap(),
            );
            json_content_type(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/cloudevents+json"));
        assert!(!with("text/json"));
        assert!(!with("application/+json"));
        assert!(!with("text/plain"));
        assert!(!json_content_type(&axum::http::HeaderMap::new()));
    }

    async fn query<T: DeserializeOwned>(uri: &str) -> Result<T, ApiError> {
        let (mut parts, _) = Request::builder()
            .uri(uri)
            .body(Body::empty())
            .unwrap()
            .into_parts();
        Query::<T>::from_request_parts(&mut parts, &())
            .await
            .map(|Query(q)| q)
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Window {
        from: Option<String>,
        to: Option<String>,
    }

    #[tokio::test]
    async fn query_refuses_a_repeated_field_and_names_it() {
        let w: Window = query("/v1/usage?from=a&to=b").await.unwrap();
        assert_eq!((w.from.as_deref(), w.to.as_deref()), (Some("a"), Some("b")));
        let e = query::<Window>("/v1/usage?from=a&from=b")
            .await
            .unwrap_err();
        assert_eq!(
            said(&e),
            (
                ErrorCode::InvalidRequest,
                "`from` is given more than once in the query string.",
                Some("from")
            )
        );
        // Percent-encoded names are the same field.
        let e = query::<Window>("/v1/usage?to=a&%74o=b").await.unwrap_err();
        assert_eq!(e.param.as_deref(), Some("to"));
        let w: Window = query("/v1/usage").await.unwrap();
        assert!(w.from.is_none() && w.to.is_none());
    }
}
