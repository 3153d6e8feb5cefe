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
mod tests;
