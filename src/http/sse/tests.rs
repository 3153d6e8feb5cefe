//! The chat stream's bytes: several ready events in one write, `id:` numbering, and the
//! events a resuming client already has left out.

#![expect(clippy::unwrap_used)]

use bytes::Bytes;
use http_body_util::BodyExt;
use switchyard_actors::output::RawJson;

use super::*;

fn usage() -> Usage {
    Usage {
        prompt_tokens: 3,
        completion_tokens: 2,
        finish_reason: "stop".into(),
        cached_tokens: None,
    }
}

fn raw(text: &str) -> Piece {
    let mut piece = Piece::text("");
    piece.raw = RawJson::parse(text);
    piece
}

/// Every write of the response to a replayed `events`.
async fn writes(render: Render, skip_through: Option<u64>, events: Vec<GenEvent>) -> Vec<Bytes> {
    let response = sse_response_after(Source::Replay(events.into_iter()), render, skip_through);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(response.headers()["cache-control"], "no-cache");
    let mut body = response.into_body();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        out.push(frame.unwrap().into_data().unwrap());
    }
    out
}

const HEAD: &str = r#"{"id":"c1","object":"chat.completion.chunk","created":7,"model":"m","system_fingerprint":"fp_switchyard","#;

#[tokio::test]
async fn ready_events_go_out_as_one_chunk_with_the_exact_bytes() {
    let events = vec![
        GenEvent::Delta(raw(r#"{"content":"Hi"}"#)),
        GenEvent::Delta(Piece::text("a\"b")),
        GenEvent::Finished(usage()),
    ];
    let out = writes(Render::new("c1", "m", false, 7), None, events).await;
    assert_eq!(out.len(), 1, "one write for everything that was ready");
    let expected = [
        r#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#,
        r#"{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}"#,
        r#"{"index":0,"delta":{"content":"a\"b"},"logprobs":null,"finish_reason":null}"#,
        r#"{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}"#,
    ]
    .iter()
    .map(|choice| format!("data: {HEAD}\"choices\":[{choice}]}}\n\n"))
    .collect::<String>()
        + "data: [DONE]\n\n";
    assert_eq!(std::str::from_utf8(&out[0]).unwrap(), expected);
}

#[tokio::test]
async fn the_usage_chunk_and_an_error_keep_their_shapes() {
    let out = writes(
        Render::new("c1", "m", true, 7),
        None,
        vec![GenEvent::Finished(usage())],
    )
    .await;
    let text = std::str::from_utf8(&out[0]).unwrap();
    assert!(
        text.contains(r#""finish_reason":null}],"usage":null}"#),
        "{text}"
    );
    assert!(text.contains(&format!(r#"data: {HEAD}"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"#)), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));

    let failure = Failure::new(ErrorCode::ModelBackendError, "boom");
    let out = writes(
        Render::new("c1", "m", false, 7),
        None,
        vec![GenEvent::Delta(Piece::text("x")), GenEvent::Failed(failure)],
    )
    .await;
    let text = std::str::from_utf8(&out[0]).unwrap();
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let error: serde_json::Value =
        serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["code"], "model_backend_error");
    assert!(!text.contains("[DONE]"), "a failure ends without [DONE]");
}

#[tokio::test]
async fn a_resumable_stream_numbers_its_events_and_skips_what_the_client_has() {
    let events = || {
        vec![
            GenEvent::Delta(Piece::text("a")),
            GenEvent::Delta(Piece::text("b")),
            GenEvent::Finished(usage()),
        ]
    };
    let render = || Render::new("c1", "m", false, 7).resumable();
    let all = writes(render(), None, events()).await;
    let all = std::str::from_utf8(&all[0]).unwrap();
    let ids: Vec<&str> = all.lines().filter_map(|l| l.strip_prefix("id: ")).collect();
    assert_eq!(ids, ["0", "1", "2", "3", "4"], "role, a, b, finish, [DONE]");
    assert!(
        all.contains("\nid: 1\n\n"),
        "id after data, then the blank line"
    );

    // After `Last-Event-ID: 1` the client gets b, the finish and [DONE], unchanged.
    let rest = writes(render(), Some(1), events()).await;
    let rest = std::str::from_utf8(&rest[0]).unwrap();
    let from_b = &all[all.find("data: ").unwrap()..];
    let from_b = &from_b[from_b.find("id: 1\n\n").unwrap() + "id: 1\n\n".len()..];
    assert_eq!(rest, from_b);
}

#[tokio::test]
async fn a_legacy_completion_has_no_role_chunk() {
    let render = Render::with_dialect(Dialect::Completions, "c1", "m", false, 7);
    let out = writes(
        render,
        None,
        vec![
            GenEvent::Delta(Piece::text("x")),
            GenEvent::Finished(usage()),
        ],
    )
    .await;
    let head = r#"{"id":"c1","object":"text_completion","created":7,"model":"m","#;
    assert_eq!(
        std::str::from_utf8(&out[0]).unwrap(),
        format!(
            "data: {head}\"choices\":[{{\"index\":0,\"text\":\"x\",\"logprobs\":null,\"finish_reason\":null}}]}}\n\n\
             data: {head}\"choices\":[{{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"stop\"}}]}}\n\n\
             data: [DONE]\n\n"
        )
    );
}
