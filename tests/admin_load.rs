//! Issue 31: what reads of the admin port may cost. The attempts a queue keeps are bounded in
//! bytes whatever its messages' ids and keys (item 7).
//!
//! Every API read carries the admin token, so these hold whether or not reads need it.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use sluice::broker::Headers;
use support::*;

const DEADLINE: Duration = Duration::from_secs(60);
const TOKEN: &str = "admin-load-test-token-0123456789";

/// `sluice run` on `place` with the admin port, the token [`TOKEN`], until `queue`'s worker is up.
async fn runner<P: Place>(dir: &std::path::Path, place: &P, queue: &str, extra: &[&str]) -> (Sluice, String) {
    run_with_admin_env(dir, &place.url(), queue, extra, &[("SLUICE_ADMIN_TOKEN", TOKEN)]).await
}

/// GETs `path` of the admin API with the token; the status and the body.
async fn api(admin: &str, path: &str) -> (u16, Vec<u8>) {
    let response = http()
        .get(format!("http://{admin}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = response.status().as_u16();
    (status, response.bytes().await.unwrap_or_else(|e| panic!("GET {path}: {e}")).to_vec())
}

/// Issue 31 item 7: 250 messages with 256 KiB ids and keys took the runner from 33 to 151 MB,
/// and `/attempts` answered 105 MB. Here 60 messages with 100 KiB ids and keys (a webhook
/// receiver takes their headers): the attempts answer stays under the ring's bound, and each
/// long id and key is kept cut, saying so and how long it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_ids_and_keys_are_cut_and_the_attempts_stay_bounded() {
    const MESSAGES: usize = 60;
    const LONG: usize = 100 << 10;
    let place = EmbeddedDir::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let (_sluice, admin) = runner(dir.path(), &place, "work", &[]).await;
    for i in 0..MESSAGES {
        let (id, key) = (format!("{i:04}{}", "i".repeat(LONG)), format!("{i:04}{}", "k".repeat(LONG)));
        let body = json!({ "id": id, "type": "t", "idempotency_key": key, "payload": {} });
        publish_raw(&broker, "ev", "x", body.to_string().into_bytes(), Headers::new()).await;
    }
    wait_until(DEADLINE, "every message handled", || async { receiver.succeeded_keys().len() == MESSAGES }).await;
    let (status, body) = api(&admin, "/api/v1/queues/work/attempts").await;
    assert_eq!(status, 200);
    assert!(body.len() <= 2 << 20, "the attempts answer is {} bytes, over the ring's 2 MiB", body.len());
    let attempts: Value = serde_json::from_slice(&body).expect("JSON");
    let attempts = attempts["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), MESSAGES, "every attempt kept (each is small once cut)");
    let marker = format!("(cut from {} bytes)", LONG + 4);
    for attempt in attempts {
        for field in ["message_id", "idempotency_key"] {
            let text = attempt[field].as_str().unwrap_or_else(|| panic!("{field} in {attempt}"));
            assert!(text.len() < 1024, "{field} kept at {} bytes", text.len());
            assert!(text.ends_with(&marker), "{field} says it was cut and from how long: {text:?}");
        }
    }
}
