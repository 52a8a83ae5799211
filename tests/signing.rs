//! Webhook signing with several secrets (issue 24): a secret rotated by editing its secrets
//! file under load, and secrets from files never shown by `plan`, `validate`, `status`, the
//! logs or the admin port.
//!
//! The receiver verifies every call itself, with its own implementation of the Standard
//! Webhooks scheme (HMAC-SHA256 of `id.timestamp.body`, base64), against the secrets it
//! accepts at that moment; when Python's `standardwebhooks` (the reference library) is
//! installed, every call is verified again with it afterwards.

use crate::support;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac as _};
use serde_json::json;
use support::*;

const DEADLINE: Duration = Duration::from_secs(60);

const OLD: &str = "whsec_b2xkIHNpZ25pbmcga2V5IGZvciBpc3N1ZSAyNA==";
const NEW: &str = "whsec_bmV3IHNpZ25pbmcga2V5IGZvciBpc3N1ZSAyNA==";

/// Whether `headers` carry a Standard Webhooks signature of `body` under any of `secrets`.
fn verifies(secrets: &[&str], hit: &Hit) -> bool {
    let (Some(id), Some(timestamp), Some(signatures)) =
        (hit.header("webhook-id"), hit.header("webhook-timestamp"), hit.header("webhook-signature"))
    else {
        return false;
    };
    secrets.iter().any(|secret| {
        let key = BASE64.decode(secret.trim_start_matches("whsec_")).expect("test secret is base64");
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(&key).expect("any key length");
        mac.update(format!("{id}.{timestamp}.").as_bytes());
        mac.update(&hit.body);
        let expected = format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()));
        signatures.split(' ').any(|s| s == expected)
    })
}

/// A call as the receiver saw it, and the secrets it accepted then.
struct Checked {
    hit: Hit,
    accepted: Vec<&'static str>,
    verified: bool,
}

/// Verifies every call again with Python's `standardwebhooks`, when installed; the calls
/// that fail, or `None` without the library.
fn reference_failures(checked: &[Checked]) -> Option<usize> {
    let available = Command::new("python3").args(["-c", "import standardwebhooks"]).output();
    if !available.is_ok_and(|out| out.status.success()) {
        eprintln!("python3 with standardwebhooks not found: calls verified by the test's own implementation only");
        return None;
    }
    let calls: Vec<_> = checked
        .iter()
        .map(|c| {
            let headers: serde_json::Map<String, serde_json::Value> =
                c.hit.headers.iter().map(|(n, v)| (n.clone(), json!(v))).collect();
            json!({"secrets": c.accepted, "headers": headers, "body": String::from_utf8_lossy(&c.hit.body)})
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("calls.json");
    std::fs::write(&input, serde_json::to_vec(&calls).expect("json")).expect("write calls");
    let script = r#"
import json, sys
from standardwebhooks.webhooks import Webhook
failures = 0
for call in json.load(open(sys.argv[1])):
    ok = False
    for secret in call["secrets"]:
        try:
            Webhook(secret).verify(call["body"], call["headers"])
            ok = True
        except Exception:
            pass
    failures += 0 if ok else 1
print(failures)
"#;
    let out = Command::new("python3").args(["-c", script]).arg(&input).output().expect("python3 runs");
    assert!(out.status.success(), "the reference verifier failed: {}", String::from_utf8_lossy(&out.stderr));
    Some(String::from_utf8_lossy(&out.stdout).trim().parse().expect("a count"))
}

/// Issue 24: the secret is rotated by editing the secrets file while messages flow (old
/// secret, then old and new, then new). The receiver accepts the old secret until the first
/// call signed with both arrives, the new one from then on; every call verifies against what
/// it accepts at that moment, none fails, and every message is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_rotated_in_its_file_under_load_fails_no_call() {
    let accepted: Arc<Mutex<Vec<&'static str>>> = Arc::new(Mutex::new(vec![OLD]));
    let checked: Arc<Mutex<Vec<Checked>>> = Arc::default();
    let receiver = {
        let (accepted, checked) = (accepted.clone(), checked.clone());
        Receiver::start(move |hit, _| {
            let mut accepted = accepted.lock().expect("lock");
            // The receiver's operator moves to the new secret once the sender signs with both.
            if hit.header("webhook-signature").is_some_and(|s| s.split(' ').count() == 2) {
                *accepted = vec![NEW];
            }
            let verified = verifies(&accepted, hit);
            checked.lock().expect("lock").push(Checked { hit: hit.clone(), accepted: accepted.clone(), verified });
            if verified { Reply::ok() } else { Reply::status(401) }
        })
        .await
    };
    let dir = webhook_pipeline(&receiver, "    concurrency: 8\n");
    let yaml = webhook_yaml(&receiver, "    concurrency: 8\n")
        .replace("webhook: {url: ", "webhook: {signing: {secret_file: secrets.txt}, url: ");
    std::fs::write(dir.path().join("pipeline.yaml"), yaml).expect("write the pipeline");
    let secrets = dir.path().join("secrets.txt");
    std::fs::write(&secrets, format!("{OLD}\n")).expect("write the secrets");
    let place = EmbeddedDir::new();
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _run = Sluice::run(dir.path(), &place.url(), &[]);

    // Messages flow from here to the end: one every 5 ms.
    let published = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let publisher = {
        let (broker, published, stop) = (broker.clone(), published.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let n = published.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                publish(&broker, "ev", "x", &format!("k-{n}"), json!({"n": n})).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let signatures = |hit: &Hit| hit.header("webhook-signature").map_or(0, |s| s.split(' ').count());
    let calls = || checked.lock().expect("lock").iter().map(|c| signatures(&c.hit)).collect::<Vec<_>>();
    wait_until(DEADLINE, "50 calls signed with the old secret", || async { calls().len() >= 50 }).await;

    // Editing in place (truncate, then write), as an editor without atomic saves does.
    std::fs::write(&secrets, format!("# rotating\n{OLD}\n{NEW}\n")).expect("edit the secrets");
    wait_until(DEADLINE, "50 calls signed with both secrets", || async {
        calls().iter().filter(|&&n| n == 2).count() >= 50
    })
    .await;
    std::fs::write(&secrets, format!("{NEW}\n")).expect("edit the secrets");
    wait_until(DEADLINE, "50 calls signed with the new secret alone after the rotation", || async {
        let calls = calls();
        let rotated = calls.iter().position(|&n| n == 2).unwrap_or(calls.len());
        calls[rotated..].iter().filter(|&&n| n == 1).count() >= 50
    })
    .await;
    stop.cancel();
    publisher.await.expect("publisher");
    let total = published.load(std::sync::atomic::Ordering::SeqCst);
    wait_until(DEADLINE, "every message handled", || async { receiver.succeeded_keys().len() >= total }).await;

    let checked = std::mem::take(&mut *checked.lock().expect("lock"));
    let failed: Vec<_> = checked.iter().filter(|c| !c.verified).map(|c| (c.hit.key(), &c.accepted)).collect();
    assert!(failed.is_empty(), "{} of {} calls failed to verify: {failed:?}", failed.len(), checked.len());
    let counts = counts(checked.iter().map(|c| signatures(&c.hit).to_string()));
    assert!(counts.keys().eq(["1", "2"]), "signatures per call: {counts:?}");
    assert_eq!(reference_failures(&checked).unwrap_or(0), 0, "calls the reference verifier refused");
    assert!(place.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
}

/// Issue 24: secrets read from a file appear in no output: `validate`, `plan`, `status`, the
/// run's logs at debug, its admin port, and the refusal of a file with a malformed line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_from_a_file_are_never_shown() {
    let receiver = Receiver::ok().await;
    let yaml =
        webhook_yaml(&receiver, "").replace("webhook: {url: ", "webhook: {signing: {secret_file: secrets.txt}, url: ");
    let dir = pipeline(&yaml);
    let secrets = dir.path().join("secrets.txt");
    std::fs::write(&secrets, format!("{OLD}\n{NEW}\n")).expect("write the secrets");
    let path = dir.path().to_str().expect("utf-8 path");
    let place = EmbeddedDir::new();
    let url = place.url();
    let shown = |what: &str, text: &str| {
        for secret in [OLD, NEW] {
            let key = secret.trim_start_matches("whsec_");
            assert!(!text.contains(key), "{what} shows a secret:\n{text}");
        }
    };
    let mut outputs = Vec::new();
    for args in [
        vec!["validate", path],
        vec!["validate", path, "--format", "json"],
        vec!["plan", path],
        vec!["plan", path, "--format", "json"],
    ] {
        let out = sluice_cli(&args, &[], DEADLINE);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        outputs.push((format!("{args:?}"), out.stdout + &out.stderr));
    }
    let (mut run, admin) = run_with_admin_and(dir.path(), &url, "work", &[]).await;
    let broker = place.connect().await;
    publish(&broker, "ev", "x", "k-1", json!({})).await;
    receiver.wait_for(1, DEADLINE).await;
    let status = sluice_cli(&["status", path, "--broker", &url], &[], DEADLINE);
    outputs.push(("status".into(), status.stdout + &status.stderr));
    for endpoint in ["metrics", "healthz", "readyz"] {
        let body = http().get(format!("http://{admin}/{endpoint}")).send().await.expect("admin answers");
        outputs.push((endpoint.into(), body.text().await.expect("text")));
    }
    assert_eq!(run.stop(DEADLINE), Some(0));
    outputs.push(("run's log".into(), run.log()));
    assert!(verifies(&[OLD], &receiver.hits()[0]) && verifies(&[NEW], &receiver.hits()[0]), "signed with both");

    // A malformed line stops `run`, naming the file and the line, never the secret.
    std::fs::write(&secrets, format!("{OLD}\nwhsec_{}!\n", NEW.trim_start_matches("whsec_"))).expect("write");
    let refused = sluice_cli(&["run", path, "--broker", &url, "--exit-when-idle"], &[], DEADLINE);
    assert_eq!(refused.code, Some(1), "{refused:?}");
    assert!(refused.stderr.contains("secrets.txt, line 2: "), "{}", refused.stderr);
    outputs.push(("the refusal".into(), refused.stdout + &refused.stderr));
    let validate = sluice_cli(&["validate", path], &[], DEADLINE);
    assert_eq!(validate.code, Some(0), "a warning only: {validate:?}");
    assert!(validate.stdout.contains("warning") && validate.stdout.contains("line 2"), "{validate:?}");
    outputs.push(("validate's warning".into(), validate.stdout + &validate.stderr));
    for (what, text) in &outputs {
        shown(what, text);
    }
}
