//! Cancellation: 202 while running, `cancelled` only once the node confirms; a finished
//! generation stays finished; only the owner may see or cancel it.

use std::time::Duration;

use serde_json::Value;
use switchyard::store::{NewApiKey, display_prefix, hash_secret};

use crate::harness::{Events, body, pg_fleet, until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_racing_completion_in_both_orders() {
    let f = pg_fleet(&[("small", 1)], 10.0, |_| {}).await;

    // Completion first: the cancel finds it completed and leaves it so.
    let resp = f.submit("done-first", &body("short", 5, false)).await;
    assert_eq!(resp.status(), 200);
    let done: Value = resp.json().await.unwrap();
    let id = done["id"].as_str().unwrap().to_owned();
    assert_eq!(done["status"], "completed");
    let (status, after) = f.cancel(&id).await;
    assert_eq!((status, after["status"].as_str()), (200, Some("completed")));
    let (_, doc) = f.get(&id).await;
    assert_eq!(doc["status"], "completed");
    assert_eq!(doc["output"][0]["text"], done["output"][0]["text"]);

    // Cancel first: accepted at once, confirmed by the node, then final.
    let mut events = Events::new(f.submit("cancel-first", &body("long", 5000, true)).await);
    let id = events.next().await.unwrap().1["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(events.next().await.unwrap().0, "generation.text.delta");
    let (status, c) = f.cancel(&id).await;
    assert_eq!(
        (status, c["status"].as_str()),
        (202, Some("cancel_requested"))
    );
    let rest = events.rest().await;
    assert_eq!(rest.last().unwrap().0, "generation.cancelled");
    let (status, again) = f.cancel(&id).await;
    assert_eq!(
        (status, again["status"].as_str()),
        (200, Some("cancelled")),
        "idempotent"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, doc) = f.get(&id).await;
    assert_eq!(doc["status"], "cancelled", "terminal states never change");
    until(
        Duration::from_secs(5),
        "the sequence to leave the engine",
        || async { f.engine_running() == 0 },
    )
    .await;

    // Another principal sees nothing of it and cannot cancel it.
    let other = switchyard::store::new_secret("sk-").unwrap();
    f.store
        .create_api_key(NewApiKey {
            team_id: f.team_id,
            hash: hash_secret(&other),
            prefix: display_prefix(&other),
            ..NewApiKey::default()
        })
        .await
        .unwrap();
    for req in [
        crate::common::http().get(f.url(&format!("/v1/generations/{id}"))),
        crate::common::http().post(f.url(&format!("/v1/generations/{id}/cancel"))),
    ] {
        let resp = req.bearer_auth(&other).send().await.unwrap();
        assert_eq!(resp.status(), 404);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "not_found");
    }
    // The same key under another principal is another generation.
    let theirs = f
        .submit_as(&other, "cancel-first", &body("long", 5, false))
        .await;
    assert_eq!(theirs.status(), 200);
    let theirs: Value = theirs.json().await.unwrap();
    assert_ne!(theirs["id"].as_str(), Some(id.as_str()));
    f.stop().await;
}
