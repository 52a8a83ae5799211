//! Scheduled messages (issue 24): `sluice publish --delay/--at` sets the envelope's
//! `not_before`, and the message is not handled before then, nor more than a second after,
//! on every broker, across a runner killed and started again; a time past is now; a time
//! further ahead than the broker holds is refused.
//!
//! The receiver records when each call arrives (the wall clock, as `not_before` is) and the
//! `not_before` its body carries; nothing else of sluice's timing is looked at.

use crate::support;

use sluice::broker::Broker as _;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use support::*;

const DEADLINE: Duration = Duration::from_secs(60);

/// How late after its time a message may be handled (the requirement), plus the
/// millisecond `not_before` is written to.
const LATE: Duration = Duration::from_millis(1001);

/// Per idempotency key: the `not_before` the call's envelope carried and when the first call
/// arrived.
type Arrivals = Arc<Mutex<BTreeMap<String, (Option<SystemTime>, SystemTime)>>>;

/// A receiver answering 200 that records [`Arrivals`].
async fn recording_receiver() -> (Receiver, Arrivals) {
    let arrivals = Arrivals::default();
    let recorded = arrivals.clone();
    let receiver = Receiver::start(move |hit, _| {
        let now = SystemTime::now();
        let not_before = hit.json()["not_before"].as_str().map(|t| humantime::parse_rfc3339(t).expect("RFC 3339"));
        recorded.lock().expect("lock").entry(hit.key().to_string()).or_insert((not_before, now));
        Reply::ok()
    })
    .await;
    (receiver, arrivals)
}

/// `sluice publish` of the payloads in `jsonl` to exchange `ev` with `schedule` flags.
fn publish_scheduled(url: &str, jsonl: &Path, schedule: &[&str]) -> Finished {
    let jsonl = jsonl.to_str().expect("utf-8 path");
    let args = ["publish", "--broker", url, "--exchange", "ev", "--routing-key", "x", "--type", "t", "--jsonl", jsonl];
    let args: Vec<&str> = args.into_iter().chain(schedule.iter().copied()).collect();
    sluice_cli(&args, &[], DEADLINE)
}

/// Issue 24: 200 messages in 20 publishes, alternately `--delay` and `--at`, due in two waves
/// a few seconds apart. Each is handled not before its time and within a second after it.
/// Between the waves the runner is killed (SIGKILL) and started again: the second wave,
/// waiting in the broker meanwhile, is all handled, on time.
async fn scheduled_messages_are_handled_on_time_across_a_restart<P: Place>(place: P) {
    let (receiver, arrivals) = recording_receiver().await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 16\n");
    let url = place.url();
    declare(dir.path(), &place.connect().await).await;
    let mut run = Sluice::run(dir.path(), &url, &[]);

    let start = SystemTime::now();
    let publishes: Vec<_> = (0..20u64)
        .map(|g| {
            let wave = if g < 10 { 6_000 } else { 16_000 };
            let target = start + Duration::from_millis(wave + (g % 10) * 150);
            let jsonl = dir.path().join(format!("g{g}.jsonl"));
            let lines: Vec<String> = (0..10).map(|i| format!("{{\"g\": {g}, \"i\": {i}}}")).collect();
            std::fs::write(&jsonl, lines.join("\n")).expect("write payloads");
            let url = url.clone();
            std::thread::spawn(move || {
                let flag = if g % 2 == 0 {
                    let left = target.duration_since(SystemTime::now()).expect("published before its time");
                    ["--delay".to_string(), format!("{}ms", left.as_millis())]
                } else {
                    ["--at".to_string(), humantime::format_rfc3339_millis(target).to_string()]
                };
                publish_scheduled(&url, &jsonl, &[&flag[0], &flag[1]])
            })
        })
        .collect();
    for publish in publishes {
        let out = publish.join().expect("publish thread");
        assert_eq!(out.code, Some(0), "{out:?}");
    }
    let count = || arrivals.lock().expect("lock").len();
    wait_until(DEADLINE, "the first wave handled", || async { count() >= 100 }).await;
    run.signal(libc::SIGKILL);
    run.wait(DEADLINE);
    let _run = Sluice::run(dir.path(), &url, &[]);
    wait_until(DEADLINE, "the second wave handled", || async { count() >= 200 }).await;

    let arrivals = arrivals.lock().expect("lock").clone();
    assert_eq!(arrivals.len(), 200, "messages handled");
    let mut early_or_late = Vec::new();
    for (key, (not_before, at)) in &arrivals {
        let not_before = not_before.unwrap_or_else(|| panic!("{key}: the envelope has no not_before"));
        match at.duration_since(not_before) {
            Ok(late) if late <= LATE => {}
            Ok(late) => early_or_late.push(format!("{key}: {late:?} late")),
            Err(early) => early_or_late.push(format!("{key}: {:?} early", early.duration())),
        }
    }
    assert!(early_or_late.is_empty(), "{} of 200 not on time: {early_or_late:#?}", early_or_late.len());
    assert!(place.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
}

/// Issue 24: `--at` a time past is now: handled at once (within a second of the publish, the
/// runner consuming already: its start-up is not what is measured).
async fn a_time_past_is_now<P: Place>(place: P) {
    let (receiver, arrivals) = recording_receiver().await;
    let dir = webhook_pipeline(&receiver, "");
    let url = place.url();
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _run = Sluice::run(dir.path(), &url, &[]);
    wait_until(DEADLINE, "the runner consuming work", || async {
        broker.stats("work").await.is_ok_and(|s| s.consumers >= 1)
    })
    .await;
    let jsonl = dir.path().join("one.jsonl");
    std::fs::write(&jsonl, "{}\n").expect("write payload");
    let out = publish_scheduled(&url, &jsonl, &["--at", "2026-01-01T01:00:00+01:00"]);
    let published = SystemTime::now();
    assert_eq!(out.code, Some(0), "{out:?}");
    receiver.wait_for(1, DEADLINE).await;
    let (not_before, at) = arrivals.lock().expect("lock").values().next().copied().expect("one arrival");
    assert_eq!(not_before, Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600)));
    assert!(at.duration_since(published).unwrap_or_default() <= LATE, "handled {at:?}, published {published:?}");
}

on_every_broker!(scheduled_messages_are_handled_on_time_across_a_restart, a_time_past_is_now);

/// Issue 24: on RabbitMQ a time further ahead than the delay cascade holds (about 38.8 days)
/// is refused before anything is sent, naming the limit; the embedded broker holds any time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_too_far_ahead_is_refused_where_the_broker_cannot_hold_it() {
    let vhost = Vhost::new();
    let dir = webhook_pipeline(&Receiver::ok().await, "");
    declare(dir.path(), &vhost.connect().await).await;
    let jsonl = dir.path().join("one.jsonl");
    std::fs::write(&jsonl, "{}\n").expect("write payload");
    for flag in [["--delay", "39d"], ["--at", "2099-01-01T00:00:00Z"]] {
        let out = publish_scheduled(&vhost.url(), &jsonl, &flag);
        assert_eq!(out.code, Some(1), "{flag:?}: {out:?}");
        assert!(
            out.stderr.contains(
                "further than this broker can hold a message back (at most 38d 20h 4m 3s): nothing was published"
            ),
            "{flag:?}: {}",
            out.stderr
        );
    }
    assert_eq!(vhost.depth("work").await, 0, "nothing published");
    let held = publish_scheduled(&vhost.url(), &jsonl, &["--delay", "38d"]);
    assert_eq!(held.code, Some(0), "within the cascade: {held:?}");

    let place = EmbeddedDir::new();
    declare(dir.path(), &place.connect().await).await;
    let far = publish_scheduled(&place.url(), &jsonl, &["--at", "2099-01-01T00:00:00Z"]);
    assert_eq!(far.code, Some(0), "the embedded broker holds any delay: {far:?}");
}
