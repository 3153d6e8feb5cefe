//! `POST /v1/embeddings`, for models configured as embedding models (`embedding = true`):
//! the same admission, queue and ledger as generations, billed by input tokens only. The
//! engine's `data` array is relayed as the bytes it sent.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Value;
use switchyard_actors::error::ErrorCode;
use switchyard_actors::generation::GenEvent;
use switchyard_actors::output::RawJson;
use switchyard_actors::protocol::Api;
use tracing::instrument;

use super::error::{ApiError, Json};
use super::lifecycle;
use super::openai::{self, Validated};
use crate::admission::Prompt;
use crate::server::AppState;
use switchyard_actors::generation::Launched;

/// OpenAI's bound on inputs per request.
const MAX_INPUTS: usize = 2048;

/// `POST /v1/embeddings`.
#[instrument(skip_all, fields(generation_id, team_id, model))]
pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let request_id = openai::new_request_id("embd-");
    tracing::Span::current().record("generation_id", request_id.as_str());
    match run(&state, &headers, body, &request_id).await {
        Ok(response) => response,
        Err(e) => e.with_request_id(&request_id).into_response(),
    }
}

async fn run(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Value,
    request_id: &str,
) -> Result<Response, ApiError> {
    if headers.contains_key("idempotency-key") {
        // Nothing of an embedding is retained to replay; computing it again is cheap.
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`Idempotency-Key` is not supported on /v1/embeddings.",
        ));
    }
    let (plan, _, _) = openai::prepare(state, headers, body, validate)
        .await
        .inspect_err(lifecycle::count_refusal)?;
    let model = plan.request.model.name.clone();
    let Launched::Running {
        mut generation,
        rate,
        ..
    } = lifecycle::start(state, plan, request_id).await?
    else {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`Idempotency-Key` is not supported on /v1/embeddings.",
        ));
    };
    // The engine's items, as it wrote them, from every slice the node sent.
    let mut items: Vec<RawJson> = Vec::new();
    let usage = loop {
        match generation.next().await {
            Some(GenEvent::Delta(piece)) if piece.embeddings => {
                #[derive(Deserialize)]
                struct Data {
                    data: Vec<RawJson>,
                }
                if let Some(d) = piece
                    .raw
                    .as_ref()
                    .and_then(|raw| serde_json::from_str::<Data>(raw.get()).ok())
                {
                    items.extend(d.data);
                }
            }
            Some(GenEvent::Delta(_)) => {}
            Some(GenEvent::Finished(usage)) => break usage,
            Some(GenEvent::Cancelled(_)) | None => {
                return Err(ApiError::new(
                    ErrorCode::ModelBackendError,
                    "The embedding ended unexpectedly.",
                ));
            }
            Some(GenEvent::Failed(failure)) => return Err(ApiError::from(failure)),
        }
    };
    if items.is_empty() {
        return Err(ApiError::new(
            ErrorCode::ModelBackendError,
            "The engine answered without embeddings.",
        ));
    }
    let data: Vec<&str> = items.iter().map(RawJson::get).collect();
    let model = super::sse::json_string(&model);
    let p = usage.prompt_tokens;
    let body = format!(
        r#"{{"object":"list","data":[{}],"model":{model},"usage":{{"prompt_tokens":{p},"total_tokens":{p}}}}}"#,
        data.join(",")
    );
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    super::error::rate_headers(&rate, response.headers_mut());
    Ok(response)
}

fn validate(state: &AppState, body: Value) -> Result<Validated, ApiError> {
    let bad = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m);
    let Value::Object(mut obj) = body else {
        return Err(bad("The body must be a JSON object."));
    };
    let resolved = lifecycle::resolve_model(state, &obj)?;
    let (texts, token_lists) = inputs(obj.get("input"))?;
    match obj.get("encoding_format") {
        None | Some(Value::Null) => {}
        Some(Value::String(f)) if f == "float" || f == "base64" => {}
        Some(_) => {
            return Err(
                bad("`encoding_format` must be `float` or `base64`.").with_param("encoding_format")
            );
        }
    }
    if obj.contains_key("stream") {
        return Err(bad("Embeddings are not streamed.").with_param("stream"));
    }
    obj.insert("model".into(), Value::String(resolved.name.clone()));
    Ok(Validated {
        resolved,
        stream: false,
        include_usage: false,
        max_tokens: Some(0),
        engine_body: Value::Object(obj),
        prompt: Prompt::Texts {
            api: Api::Embeddings,
            texts,
            token_lists,
            param: "input",
        },
    })
}

/// `input`: a string, a list of strings, token ids, or a list of token id lists; none empty.
fn inputs(value: Option<&Value>) -> Result<(Vec<String>, Vec<u64>), ApiError> {
    let bad = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m).with_param("input");
    let ids = |v: &Value| -> Option<u64> {
        let a = v.as_array()?;
        (!a.is_empty() && a.iter().all(|t| t.as_u64().is_some())).then_some(a.len() as u64)
    };
    match value {
        Some(Value::String(s)) if !s.is_empty() => Ok((vec![s.clone()], Vec::new())),
        Some(v @ Value::Array(items)) if !items.is_empty() && items.len() <= MAX_INPUTS => {
            if let Some(n) = ids(v) {
                return Ok((Vec::new(), vec![n]));
            }
            let mut texts = Vec::new();
            let mut token_lists = Vec::new();
            for item in items {
                match item {
                    Value::String(s) if !s.is_empty() => texts.push(s.clone()),
                    other => match ids(other) {
                        Some(n) => token_lists.push(n),
                        None => {
                            return Err(bad(
                                "Every `input` item must be a non-empty string or token id list.",
                            ));
                        }
                    },
                }
            }
            Ok((texts, token_lists))
        }
        Some(Value::Array(items)) if items.len() > MAX_INPUTS => Err(bad(&format!(
            "`input` may hold at most {MAX_INPUTS} items."
        ))),
        None | Some(Value::Null) => Err(bad("`input` is required.")),
        _ => Err(bad(
            "`input` must be a non-empty string, a list of them, or token ids.",
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn inputs_are_texts_or_token_ids_and_never_empty() {
        assert_eq!(
            inputs(Some(&json!("a"))).unwrap(),
            (vec!["a".into()], vec![])
        );
        assert_eq!(
            inputs(Some(&json!(["a", "b"]))).unwrap(),
            (vec!["a".into(), "b".into()], vec![])
        );
        assert_eq!(inputs(Some(&json!([1, 2]))).unwrap(), (vec![], vec![2]));
        assert_eq!(
            inputs(Some(&json!([[1], [2, 3]]))).unwrap(),
            (vec![], vec![1, 2])
        );
        let many = Value::Array(vec![json!("x"); MAX_INPUTS + 1]);
        for bad in [
            json!(""),
            json!([]),
            json!([""]),
            json!([[]]),
            json!(3),
            many,
        ] {
            assert!(inputs(Some(&bad)).is_err(), "{bad}");
        }
        assert!(inputs(None).is_err());
    }
}
