//! `POST /v1/completions`: the legacy completions API (vLLM's `benchmark_serving`, code
//! autocomplete clients). The same pipeline as chat (admission, queue, metering,
//! cancellation); rendered as `text_completion` chunks or one document.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use switchyard_actors::error::ErrorCode;
use switchyard_actors::protocol::Api;
use tracing::instrument;

use super::error::{ApiError, Json};
use super::lifecycle;
use super::openai::{self, Validated};
use super::sse::Dialect;
use crate::admission::Prompt;
use crate::server::AppState;

/// vLLM's and OpenAI's `max_tokens` when a completion request sets none.
const DEFAULT_MAX_TOKENS: u64 = 16;

/// `POST /v1/completions`.
#[instrument(skip_all, fields(generation_id, team_id, model))]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let request_id = openai::new_request_id("cmpl-");
    tracing::Span::current().record("generation_id", request_id.as_str());
    match openai::run(
        &state,
        &headers,
        body,
        &request_id,
        Dialect::Completions,
        validate,
    )
    .await
    {
        Ok(response) => response,
        Err(e) => e.with_request_id(&request_id).into_response(),
    }
}

fn validate(state: &AppState, body: Value) -> Result<Validated, ApiError> {
    let bad = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m);
    let Value::Object(mut obj) = body else {
        return Err(bad("The body must be a JSON object."));
    };
    let resolved = lifecycle::resolve_model(state, &obj)?;
    let (texts, token_lists) = prompt(obj.get("prompt"))?;
    openai::one_choice(&obj, "n")?;
    openai::one_choice(&obj, "best_of")?;
    let (stream, include_usage) = openai::stream_options(&obj)?;
    let max_tokens = openai::output_cap(&mut obj, &resolved, &["max_tokens"], DEFAULT_MAX_TOKENS)?;
    obj.insert("model".into(), Value::String(resolved.name.clone()));
    obj.remove("stream_options");
    Ok(Validated {
        resolved,
        stream,
        include_usage,
        max_tokens: max_tokens.or(Some(DEFAULT_MAX_TOKENS)),
        engine_body: Value::Object(obj),
        prompt: Prompt::Texts {
            api: Api::Completions,
            texts,
            token_lists,
            param: "prompt",
        },
    })
}

/// One prompt: a string, token ids, or a list holding exactly one of those (several prompts
/// would be several choices, which a request may not ask for).
fn prompt(value: Option<&Value>) -> Result<(Vec<String>, Vec<u64>), ApiError> {
    let bad = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m).with_param("prompt");
    let one = |v: &Value| match v {
        Value::String(s) => Ok((vec![s.clone()], Vec::new())),
        Value::Array(ids) if !ids.is_empty() && ids.iter().all(|t| t.as_u64().is_some()) => {
            Ok((Vec::new(), vec![ids.len() as u64]))
        }
        _ => Err(bad(
            "`prompt` must be a string, an array of token ids, or a list of one of those.",
        )),
    };
    match value {
        None | Some(Value::Null) => Err(bad("`prompt` is required.")),
        Some(Value::Array(items)) if items.len() == 1 && !items[0].is_u64() => one(&items[0]),
        Some(Value::Array(items)) if items.iter().any(|i| !i.is_u64()) => Err(bad(
            "`prompt` must hold one prompt: several would be several choices.",
        )),
        Some(v) => one(v),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn a_prompt_is_one_text_or_one_list_of_token_ids() {
        assert_eq!(
            prompt(Some(&json!("hi"))).unwrap(),
            (vec!["hi".into()], vec![])
        );
        assert_eq!(
            prompt(Some(&json!(["hi"]))).unwrap(),
            (vec!["hi".into()], vec![])
        );
        assert_eq!(prompt(Some(&json!([1, 2, 3]))).unwrap(), (vec![], vec![3]));
        assert_eq!(prompt(Some(&json!([[1, 2]]))).unwrap(), (vec![], vec![2]));
        for bad in [
            json!(null),
            json!(["a", "b"]),
            json!([]),
            json!([[]]),
            json!(5),
            json!({"a": 1}),
            json!([-1]),
        ] {
            let e = prompt(Some(&bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
        }
        assert!(prompt(None).is_err());
    }
}
