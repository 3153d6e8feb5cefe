//! Admission end to end over the embedded store (SQLite in memory), the in-process
//! coordinator and real queues: records, replays, conflicts, limits, measuring and the model
//! switch of a readmission.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use switchyard_actors::lifecycle::{Event, GenerationStore};
use switchyard_actors::model_queue::{ModelQueueActor, QueueArgs};
use switchyard_actors::ports::admission::{AdmissionJob, Admit, Ready};
use switchyard_actors::ports::{Clock, SystemClock, cost_of};

use super::*;
use crate::coord::MemoryCoordinator;
use crate::quota::LimitError;
use crate::store::SqliteStore;

/// Admission over a fresh in-memory store, serving every model of `config`.
async fn admission(config: Config) -> (Admission, Arc<SqliteStore>) {
    let store = Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap());
    store.migrate().await.unwrap();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let mut queues = BTreeMap::new();
    for model in &config.models {
        let args = QueueArgs {
            model: model.name.clone(),
            config: config.queue_config(model),
            clock: clock.clone(),
            cluster: None,
        };
        queues.insert(
            model.name.clone(),
            ModelQueueActor::start(args).await.unwrap(),
        );
    }
    let prompts =
        PromptCounter::load(config.models.iter().map(|m| (m.name.as_str(), None, None))).unwrap();
    let limits = Limits::new(
        Arc::new(MemoryCoordinator::new()),
        clock.clone(),
        Duration::from_secs(60),
    );
    let admission = Admission::new(
        Arc::new(config),
        store.clone(),
        queues,
        limits,
        prompts,
        clock,
    );
    (admission, store)
}

/// A person (a JWT principal): metered messages, two streams, an rpm window.
fn person() -> Principal {
    Principal {
        team_id: 1,
        key_id: None,
        subject: "user:ada".into(),
        model_allowlist: None,
        rpm: Some(100),
        max_streams: Some(2),
        tokens_per_day: None,
        message_quota: None,
        burst_capacity: None,
        burst_refill_seconds: None,
        admin: false,
        service_tiers: Default::default(),
    }
}

/// A team's service key: no message metering, so no record without an Idempotency-Key.
fn service(rpm: u32, streams: u32) -> Principal {
    Principal {
        key_id: Some(7),
        subject: "7".into(),
        rpm: Some(rpm),
        max_streams: Some(streams),
        ..person()
    }
}

fn chat(principal: Principal, model: &ModelConfig, text: &str, key: Option<&str>) -> Request {
    Request {
        principal,
        model: model.clone(),
        engine_body: json!({
            "model": model.name,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 8,
        }),
        max_tokens: 8,
        idempotency: key.map(|k| (k.to_owned(), format!("fp:{text}"))),
        prompt: Prompt::Chat,
        tier: Default::default(),
    }
}

fn ready(admit: Admit) -> Ready {
    match admit {
        Admit::Ready(ready) => *ready,
        Admit::Existing(rec) => panic!("expected a generation to run, got record {}", rec.id),
    }
}

#[tokio::test]
async fn a_keyed_request_runs_once_then_is_answered_from_its_record_or_refused() {
    let config = Config::default();
    let model = config.models[0].clone();
    let (admission, _store) = admission(config).await;

    let first = ready(
        admission
            .admit(chat(person(), &model, "hi", Some("k1")), "gen_1")
            .await
            .unwrap(),
    );
    assert_eq!(first.request_id, "gen_1");
    assert_eq!(first.model, model.name);
    assert!(first.lifecycle.is_some(), "a keyed request has a record");
    assert!(first.on_end.is_some(), "a stream place was taken");
    assert_eq!(first.limits.requests.map(|(limit, ..)| limit), Some(100));
    let r = &first.reservation;
    assert_eq!(
        (r.request_id.as_str(), r.team_id, r.key_id),
        ("gen_1", 1, None)
    );
    assert!(r.estimated_prompt_tokens > 0);
    assert_eq!(r.max_tokens, 8);
    let (pin, pout) = (model.price_input_per_mtok, model.price_output_per_mtok);
    assert_eq!(
        r.estimated_cost,
        cost_of(r.estimated_prompt_tokens, 8, pin, pout)
    );
    assert!(r.bounds.prompt_tokens > r.estimated_prompt_tokens);
    assert_eq!(r.bounds.completion_tokens, 8);

    // The same key and request: the record answers, nothing runs again.
    let again = admission
        .admit(chat(person(), &model, "hi", Some("k1")), "gen_2")
        .await
        .unwrap();
    match again {
        Admit::Existing(rec) => assert_eq!(rec.id, "gen_1"),
        Admit::Ready(r) => panic!("rerun as {}", r.request_id),
    }
    // The same key, another request.
    let conflict = admission
        .admit(chat(person(), &model, "bye", Some("k1")), "gen_3")
        .await
        .unwrap_err();
    assert_eq!(
        conflict,
        AdmissionError::Conflict {
            generation_id: "gen_1".into(),
            limits: None
        }
    );
}

#[tokio::test]
async fn a_metered_principal_gets_a_record_without_a_key_and_a_service_key_none() {
    let config = Config::default();
    let model = config.models[0].clone();
    let (admission, store) = admission(config).await;
    let person = ready(
        admission
            .admit(chat(person(), &model, "hi", None), "chatcmpl-1")
            .await
            .unwrap(),
    );
    assert!(person.lifecycle.is_some());
    let rec = store.get_generation("chatcmpl-1").await.unwrap().unwrap();
    assert_eq!(rec.subject, "user:ada");
    let service = ready(
        admission
            .admit(chat(service(10, 4), &model, "hi", None), "chatcmpl-2")
            .await
            .unwrap(),
    );
    assert!(service.lifecycle.is_none());
    assert!(store.get_generation("chatcmpl-2").await.unwrap().is_none());
}

#[tokio::test]
async fn the_limits_refuse_before_anything_is_measured_or_recorded() {
    let config = Config::default();
    let model = config.models[0].clone();
    let (admission, _store) = admission(config).await;
    let kept = admission
        .admit(chat(service(1, 4), &model, "hi", None), "a")
        .await
        .unwrap();
    let refused = admission
        .admit(chat(service(1, 4), &model, "hi", None), "b")
        .await
        .unwrap_err();
    match refused {
        AdmissionError::Limit(LimitError::Requests { limit, state, .. }) => {
            assert_eq!(limit, 1);
            assert_eq!(state.requests.map(|(_, remaining, _)| remaining), Some(0));
        }
        other => panic!("expected the rpm refusal, got {other:?}"),
    }
    drop(kept);
}

#[tokio::test]
async fn a_prompt_over_the_context_is_refused_with_the_limits_and_gives_its_place_back() {
    let mut config = Config::default();
    config.models[0].max_context_tokens = 64;
    let model = config.models[0].clone();
    let (admission, _store) = admission(config).await;
    let long = "word ".repeat(500);
    let refused = admission
        .admit(chat(service(100, 1), &model, &long, None), "a")
        .await
        .unwrap_err();
    match &refused {
        AdmissionError::Measure {
            error: MeasureError::ContextLength { context, param, .. },
            limits,
        } => {
            assert_eq!((*context, *param), (64, "messages"));
            assert!(limits.requests.is_some(), "the limits' headers go with it");
        }
        other => panic!("expected a context refusal, got {other:?}"),
    }
    // The key's one stream place was given back (by a task the dropped hook spawned).
    let mut admitted = None;
    for _ in 0..100 {
        match admission
            .admit(chat(service(100, 1), &model, "hi", None), "b")
            .await
        {
            Ok(a) => {
                admitted = Some(a);
                break;
            }
            Err(AdmissionError::Limit(LimitError::Streams { .. })) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(other) => panic!("unexpected refusal {other:?}"),
        }
    }
    assert!(admitted.is_some(), "the stream place was never given back");
}

#[tokio::test]
async fn a_model_without_a_queue_is_not_served() {
    let config = Config::default();
    let model = config.models[0].clone();
    let (admission, _store) = admission(Config {
        models: Vec::new(),
        ..config
    })
    .await;
    let refused = admission
        .admit(chat(service(100, 1), &model, "hi", None), "a")
        .await
        .unwrap_err();
    assert_eq!(refused, AdmissionError::ModelNotServed);
}

#[tokio::test]
async fn a_readmission_runs_on_the_model_version_stored_with_its_request() {
    let config = Config::default();
    let (first_model, alias_now) = (config.models[0].clone(), config.models[1].clone());
    let (admission, store) = admission(config).await;
    let first = ready(
        admission
            .admit(chat(person(), &first_model, "hi", Some("k")), "gen_1")
            .await
            .unwrap(),
    );
    // It was refused before it ran: the same key may be sent again.
    let reject = Event::Reject {
        code: "queue_full".into(),
    };
    let now_ms = SystemClock.wall().timestamp_millis();
    store
        .apply_generation("gen_1", &reject, now_ms)
        .await
        .unwrap();
    drop(first);
    // Sent again while its alias names another version: it runs on the stored one.
    let job = Box::new(admission.job(chat(person(), &alias_now, "hi", Some("k")), "gen_2"));
    let again = ready(job.run().await.unwrap());
    assert_eq!(again.request_id, "gen_1");
    assert_eq!(again.model, first_model.name);
    assert_eq!(again.body["model"], first_model.name.as_str());
    assert_eq!(again.reservation.model, first_model.name);
    assert_ne!(
        again.reservation.request_id, "gen_1",
        "a readmission's ledger row has a key of its own"
    );
}
