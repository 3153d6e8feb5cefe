//! Each domain refusal's HTTP answer: code, status, message, details and headers.

#![allow(clippy::unwrap_used)]

use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde_json::Value;

use super::*;
use crate::jwt::JwtError;

/// The response's status, headers and `error` object.
fn answer(e: ApiError) -> (StatusCode, HeaderMap, Value) {
    let body = e.body();
    let response = e.into_response();
    (
        response.status(),
        response.headers().clone(),
        body["error"].clone(),
    )
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn limits() -> LimitState {
    LimitState {
        requests: Some((60, 0, 1500)),
        tokens: Some((1000, 250, 3_600_000)),
    }
}

#[test]
fn credential_refusals_are_401_and_outages_503_with_their_waits() {
    let (status, _, error) = answer(BearerError::Repeated.into());
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error["code"], "unauthorized");
    assert_eq!(
        error["message"],
        "Send one Authorization header, not several."
    );
    for (e, message) in [
        (AuthError::UnknownKey, "Unknown API key."),
        (AuthError::KeyUnusable, "The API key is revoked or expired."),
        (AuthError::JwtNotAccepted, "JWTs are not accepted here."),
        (
            AuthError::NoTeam {
                subject: "user:a".into(),
            },
            "The token names no team.",
        ),
        (
            AuthError::UnknownTeam {
                subject: "user:a".into(),
            },
            "The token's team does not exist.",
        ),
    ] {
        let (status, headers, error) = answer(e.into());
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(error["code"], "unauthorized");
        assert_eq!(error["message"], message);
        assert_eq!(header(&headers, "retry-after"), None);
        assert_eq!(header(&headers, "x-should-retry"), Some("false"));
    }
    let (_, _, error) = answer(AuthError::Token(JwtError::UnknownKid).into());
    assert_eq!(error["message"], JwtError::UnknownKid.to_string());

    let (status, headers, error) = answer(AuthError::StoreUnavailable { subject: None }.into());
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["code"], "quota_service_unavailable");
    assert_eq!(error["message"], "Credentials cannot be checked right now.");
    assert_eq!(header(&headers, "retry-after"), None);

    let (status, headers, error) = answer(AuthError::JwksUnavailable.into());
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["message"], "Tokens cannot be verified right now.");
    assert_eq!(header(&headers, "retry-after"), Some("1"));

    let e = AuthError::KeyNotFetchedYet {
        retry_after_secs: 13,
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["code"], "quota_service_unavailable");
    assert_eq!(error["retryable"], true);
    assert_eq!(header(&headers, "retry-after"), Some("13"));
}

#[test]
fn limit_refusals_carry_their_limit_wait_and_rate_headers() {
    let (status, headers, error) = answer(LimitError::Streams { max: 3 }.into());
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(error["code"], "concurrency_limited");
    assert_eq!(
        error["message"],
        "This key already has 3 generations running."
    );
    assert_eq!(header(&headers, "retry-after"), Some("1"));
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), None);

    let e = LimitError::Requests {
        limit: 60,
        retry_after_secs: 2,
        state: limits(),
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(error["code"], "rate_limited");
    assert_eq!(error["message"], "Over 60 requests per minute.");
    assert_eq!(error["details"], json!({"limit": 60, "remaining": 0}));
    assert_eq!(header(&headers, "retry-after"), Some("2"));
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("60"));
    assert_eq!(
        header(&headers, "x-ratelimit-remaining-requests"),
        Some("0")
    );
    assert_eq!(header(&headers, "x-ratelimit-reset-requests"), Some("2s"));
    assert_eq!(
        header(&headers, "x-ratelimit-remaining-tokens"),
        Some("250")
    );
    assert_eq!(header(&headers, "x-ratelimit-reset-tokens"), Some("1h0m0s"));

    let reset_at = Utc.timestamp_millis_opt(1_800_000_000_000).single();
    let e = LimitError::TokensPerDay {
        limit: 1000,
        retry_after_secs: 3600,
        reset_at,
        state: limits(),
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(error["code"], "quota_exhausted");
    assert_eq!(
        error["message"],
        "The key's 1000 tokens for today are spent."
    );
    assert_eq!(
        error["details"],
        json!({"limit": 1000, "remaining": 0, "reset_at": "2027-01-15T08:00:00+00:00"})
    );
    assert_eq!(header(&headers, "retry-after"), Some("3600"));
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("1000"));

    let (status, headers, error) = answer(LimitError::Unavailable { check: "rpm" }.into());
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        error["message"],
        "Limits cannot be checked right now; nothing was admitted."
    );
    assert_eq!(header(&headers, "retry-after"), Some("1"));
}

#[test]
fn admission_refusals_map_to_their_codes_details_and_headers() {
    let (status, headers, error) = answer(AdmissionError::StoreUnavailable.into());
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["code"], "quota_service_unavailable");
    assert_eq!(header(&headers, "retry-after"), Some("1"));

    let e = AdmissionError::Conflict {
        generation_id: "gen_1".into(),
        limits: None,
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(error["code"], "idempotency_conflict");
    assert_eq!(error["details"], json!({"generation_id": "gen_1"}));
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), None);
    let e = AdmissionError::Conflict {
        generation_id: "gen_1".into(),
        limits: Some(limits()),
    };
    let (_, headers, _) = answer(e.into());
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("60"));

    for e in [
        AdmissionError::ModelNotServed,
        AdmissionError::StoredModelGone,
    ] {
        let (status, _, error) = answer(e.into());
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(error["code"], "model_not_found");
    }

    let e = AdmissionError::Burst {
        retry_after_secs: 3,
        limits: limits(),
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(error["code"], "rate_limited");
    assert_eq!(error["message"], "Too many generations in a short burst.");
    assert_eq!(header(&headers, "retry-after"), Some("3"));
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("1000"));

    let e = AdmissionError::Active {
        limit: 2,
        limits: LimitState::default(),
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(error["code"], "concurrency_limited");
    assert_eq!(
        error["message"],
        "2 generations are already active; wait for one to finish."
    );
    assert_eq!(error["details"], json!({"limit": 2}));
    assert_eq!(header(&headers, "retry-after"), Some("1"));

    let e = AdmissionError::Messages {
        limit: 40,
        remaining: 0,
        reset_at_ms: 1_800_000_000_000,
        retry_after_secs: 600,
        limits: limits(),
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(error["code"], "quota_exhausted");
    assert_eq!(
        error["details"],
        json!({"limit": 40, "remaining": 0, "reset_at": "2027-01-15T08:00:00Z"})
    );
    assert_eq!(header(&headers, "retry-after"), Some("600"));
    assert_eq!(
        header(&headers, "x-ratelimit-remaining-requests"),
        Some("0")
    );

    // A limit's refusal keeps exactly the headers the limit gave it.
    let e = AdmissionError::Limit(LimitError::Streams { max: 1 });
    let (_, headers, error) = answer(e.into());
    assert_eq!(error["code"], "concurrency_limited");
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), None);
}

#[test]
fn measure_refusals_name_their_field_and_carry_the_limits() {
    let e = AdmissionError::Measure {
        error: MeasureError::ContextLength {
            context: 8,
            param: "prompt",
            at_least: true,
            counted: 9,
        },
        limits: limits(),
    };
    let (status, headers, error) = answer(e.into());
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["code"], "context_length_exceeded");
    assert_eq!(error["param"], "prompt");
    assert_eq!(
        error["message"],
        "This model's maximum context length is 8 tokens; the `prompt` count at least 9 tokens, which leaves no room for output."
    );
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("60"));

    let (status, _, error) = answer(MeasureError::Template.into());
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["code"], "invalid_request");
    assert_eq!(error["param"], "messages");
    let (status, headers, error) = answer(MeasureError::Uncounted.into());
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["param"], Value::Null);
    assert_eq!(header(&headers, "retry-after"), Some("1"));
}

#[test]
fn a_generation_reports_a_refusal_with_the_same_code_and_wait() {
    let e = AdmissionError::Burst {
        retry_after_secs: 4,
        limits: limits(),
    };
    let failure = Failure::from(e.clone());
    let api = ApiError::from(e);
    assert_eq!(failure, api.failure);
    assert_eq!(failure.code, ErrorCode::RateLimited);
    assert_eq!(failure.retry_after_secs, Some(4));
}

#[test]
fn reset_durations_are_written_as_openai_writes_them() {
    assert_eq!(reset_duration(0), "0ms");
    assert_eq!(reset_duration(20), "20ms");
    assert_eq!(reset_duration(999), "999ms");
    assert_eq!(reset_duration(1000), "1s");
    assert_eq!(reset_duration(1001), "2s");
    assert_eq!(reset_duration(54_000), "54s");
    assert_eq!(reset_duration(360_000), "6m0s");
    assert_eq!(reset_duration(47_025_000), "13h3m45s");
}
