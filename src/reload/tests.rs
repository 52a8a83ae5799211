//! The mailbox alone, then `spawn` end to end against real files in temporary directories.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use super::*;

/// SIGHUP reaches every `Reloads` in the process: tests that must not see a stray
/// `Trigger::Signal` hold this shared, the one that raises SIGHUP holds it alone.
static SIGHUP: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// How long a change may take to arrive before the test fails.
const WITHIN: Duration = Duration::from_secs(2);
/// How long to listen before concluding that nothing is coming: the watcher's own delays
/// (about 0.4 s) several times over.
const SETTLE: Duration = Duration::from_millis(1500);

async fn next_within(reloads: &mut Reloads, limit: Duration) -> Option<Trigger> {
    tokio::time::timeout(limit, reloads.next()).await.ok().flatten()
}

/// Requests until one names `path`; fails after `WITHIN`.
async fn wait_for_files(reloads: &mut Reloads, path: &Path) -> Vec<PathBuf> {
    let deadline = Instant::now() + WITHIN;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match next_within(reloads, left).await {
            Some(Trigger::Files(files)) if files.iter().any(|f| f == path) => return files,
            Some(_) => {}
            None => panic!("no reload request naming {} within {WITHIN:?}", path.display()),
        }
    }
}

fn files(trigger: Option<Trigger>) -> Vec<PathBuf> {
    match trigger {
        Some(Trigger::Files(files)) => files,
        other => panic!("expected a request for changed files, got {other:?}"),
    }
}

/// A temporary directory holding `pipelines/orders.yaml`.
fn project() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let pipelines = dir.path().join("pipelines");
    fs::create_dir(&pipelines).expect("mkdir");
    fs::write(pipelines.join("orders.yaml"), "version: 1\n").expect("write");
    (dir, pipelines)
}

/// What an editor does on save: write a temporary file beside the original, rename it over.
fn save_by_rename(path: &Path, text: &str) {
    let temporary = path.with_extension("tmp");
    fs::write(&temporary, text).expect("write temporary");
    fs::rename(&temporary, path).expect("rename over");
}

#[test]
fn mailbox_merges_requests_and_hands_out_a_signal_first() {
    let mailbox = Arc::new(Mailbox::default());
    let source = Source::new(&mailbox);
    assert_eq!(mailbox.take(), Poll::Pending);

    source.post(Trigger::Files(vec!["/p/b.yaml".into(), "/p/a.yaml".into()]));
    source.post(Trigger::Signal);
    source.post(Trigger::Files(vec!["/p/a.yaml".into()]));
    source.post(Trigger::Signal);
    assert_eq!(mailbox.take(), Poll::Ready(Some(Trigger::Signal)));
    assert_eq!(mailbox.take(), Poll::Ready(Some(Trigger::Files(vec!["/p/a.yaml".into(), "/p/b.yaml".into()]))));
    assert_eq!(mailbox.take(), Poll::Pending);

    // What is pending is still handed out after the last producer has gone.
    source.post(Trigger::Signal);
    drop(source);
    assert_eq!(mailbox.take(), Poll::Ready(Some(Trigger::Signal)));
    assert_eq!(mailbox.take(), Poll::Ready(None));
}

#[tokio::test]
async fn next_wakes_up_for_a_request_posted_while_it_waits() {
    let mailbox = Arc::new(Mailbox::default());
    let mut reloads = Reloads { mailbox: mailbox.clone(), files: None, stop: CancellationToken::new() };
    let source = Source::new(&mailbox);
    let poster = tokio::spawn(async move {
        tokio::task::yield_now().await;
        source.post(Trigger::Signal);
        source
    });
    assert_eq!(next_within(&mut reloads, WITHIN).await, Some(Trigger::Signal));
    drop(poster.await.expect("poster"));
    assert_eq!(reloads.next().await, None);
}

#[tokio::test]
async fn a_saved_pipeline_file_asks_for_one_reload() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    let orders = pipelines.join("orders.yaml");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    let saved = Instant::now();
    fs::write(&orders, "version: 1\nqueues: {}\n").expect("write");
    let got = next_within(&mut reloads, WITHIN).await;
    let latency = saved.elapsed();
    assert_eq!(got, Some(Trigger::Files(vec![orders])));
    eprintln!("save-to-request latency: {latency:?}");
    assert_eq!(next_within(&mut reloads, SETTLE).await, None, "one save, one request");
}

#[tokio::test]
async fn ten_saves_within_a_second_ask_for_one_or_two_reloads() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    let orders = pipelines.join("orders.yaml");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    for i in 0..10 {
        fs::write(&orders, format!("version: 1\n# save {i}\n")).expect("write");
        tokio::time::sleep(Duration::from_millis(90)).await;
    }
    let deadline = Instant::now() + WITHIN;
    let mut requests = Vec::new();
    while let Some(trigger) = next_within(&mut reloads, deadline.saturating_duration_since(Instant::now())).await {
        requests.push(trigger);
    }
    eprintln!("ten saves, {} request(s)", requests.len());
    assert!((1..=2).contains(&requests.len()), "{requests:?}");
    assert!(requests.iter().all(|r| *r == Trigger::Files(vec![orders.clone()])), "{requests:?}");
}

#[tokio::test]
async fn files_that_never_stop_changing_still_reload() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    let orders = pipelines.join("orders.yaml");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    let writing = Duration::from_millis(2500);
    let writer = tokio::spawn({
        let orders = orders.clone();
        async move {
            let started = Instant::now();
            while started.elapsed() < writing {
                fs::write(&orders, "version: 1\n").expect("write");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let started = Instant::now();
    assert_eq!(next_within(&mut reloads, writing).await, Some(Trigger::Files(vec![orders])));
    assert!(started.elapsed() < writing, "the request waited for the writes to stop");
    writer.await.expect("writer");
}

#[tokio::test]
async fn an_editor_save_by_rename_asks_for_a_reload_and_the_watch_survives_it() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    let orders = pipelines.join("orders.yaml");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    save_by_rename(&orders, "version: 1\n# renamed\n");
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![orders.clone()]);
    fs::write(&orders, "version: 1\n# in place\n").expect("write");
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![orders]);
}

#[tokio::test]
async fn a_named_file_is_watched_by_name_through_replacements() {
    let _sighup = SIGHUP.read().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let schemas = dir.path().join("schemas");
    fs::create_dir(&schemas).expect("mkdir");
    let order = schemas.join("order.json");
    fs::write(&order, "{}").expect("write");
    fs::write(schemas.join("other.json"), "{}").expect("write");
    let mut reloads = spawn(vec![order.clone()], true).expect("spawn");

    // The unnamed sibling first: had it counted, it would show in this request or an earlier one.
    fs::write(schemas.join("other.json"), r#"{"type": "object"}"#).expect("write");
    save_by_rename(&order, r#"{"type": "object"}"#);
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![order.clone()]);
    save_by_rename(&order, r#"{"type": "array"}"#);
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![order]);
}

#[tokio::test]
async fn other_files_and_editor_scratch_files_ask_for_nothing() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    for scratch in ["notes.txt", ".orders.yaml.swp", "orders.yaml~", ".#orders.yaml", "4913", "orders.yaml.tmp"] {
        fs::write(pipelines.join(scratch), "x").expect("write");
    }
    let _ = fs::File::open(pipelines.join("orders.yaml")).expect("read");
    // Had any of the above counted, it would show in this request or an earlier one.
    let billing = pipelines.join("billing.yml");
    fs::write(&billing, "version: 1\n").expect("write");
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![billing]);
}

#[tokio::test]
async fn sighup_asks_for_a_reload_with_or_without_the_watcher() {
    let _sighup = SIGHUP.write().await;
    let (_dir, pipelines) = project();
    // Both listeners are installed before SIGHUP is raised: without one, it would end the process.
    let mut unwatched = spawn(vec![pipelines.clone()], false).expect("spawn");
    let mut watched = spawn(vec![pipelines.clone()], true).expect("spawn");

    fs::write(pipelines.join("orders.yaml"), "version: 1\n# changed\n").expect("write");
    assert_eq!(files(next_within(&mut watched, WITHIN).await), vec![pipelines.join("orders.yaml")]);
    unwatched.set_paths(vec![pipelines.join("other")]);
    assert_eq!(next_within(&mut unwatched, SETTLE).await, None, "--no-watch saw a file change");

    // SAFETY: kill(2) on our own pid with a signal we handle; no memory is involved.
    assert_eq!(unsafe { libc::kill(libc::getpid(), libc::SIGHUP) }, 0);
    assert_eq!(next_within(&mut unwatched, WITHIN).await, Some(Trigger::Signal));
    assert_eq!(next_within(&mut watched, WITHIN).await, Some(Trigger::Signal));
}

#[tokio::test]
async fn a_removed_and_recreated_pipeline_directory_is_watched_again() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    fs::remove_dir_all(&pipelines).expect("rm -r");
    wait_for_files(&mut reloads, &pipelines).await;
    fs::create_dir(&pipelines).expect("mkdir");
    // Posted after the directory is watched again.
    wait_for_files(&mut reloads, &pipelines).await;
    let billing = pipelines.join("billing.yaml");
    fs::write(&billing, "version: 1\n").expect("write");
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![billing]);
}

#[tokio::test]
async fn a_pipeline_directory_replaced_by_rename_is_watched_again_and_the_old_one_is_not() {
    let _sighup = SIGHUP.read().await;
    let (dir, pipelines) = project();
    let next = dir.path().join("pipelines.next");
    let old = dir.path().join("pipelines.old");
    fs::create_dir(&next).expect("mkdir");
    fs::write(next.join("orders.yaml"), "version: 1\n# next\n").expect("write");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    fs::rename(&pipelines, &old).expect("move away");
    fs::rename(&next, &pipelines).expect("move in");
    wait_for_files(&mut reloads, &pipelines).await;
    // A watch left on the old directory would report this as a change under `pipelines`.
    fs::write(old.join("orders.yaml"), "version: 1\n# old\n").expect("write");
    let billing = pipelines.join("billing.yaml");
    fs::write(&billing, "version: 1\n").expect("write");
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![billing]);
}

#[tokio::test]
async fn a_named_file_whose_directory_is_recreated_is_watched_again() {
    let _sighup = SIGHUP.read().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let schemas = dir.path().join("schemas");
    fs::create_dir(&schemas).expect("mkdir");
    let order = schemas.join("order.json");
    fs::write(&order, "{}").expect("write");
    let mut reloads = spawn(vec![order.clone()], true).expect("spawn");

    fs::remove_dir_all(&schemas).expect("rm -r");
    wait_for_files(&mut reloads, &order).await;
    fs::create_dir(&schemas).expect("mkdir");
    fs::write(&order, "{}").expect("write");
    wait_for_files(&mut reloads, &order).await;
    save_by_rename(&order, r#"{"type": "object"}"#);
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![order]);
}

#[tokio::test]
async fn symlink_loops_are_not_followed() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    std::os::unix::fs::symlink(&pipelines, pipelines.join("loop")).expect("symlink");
    std::os::unix::fs::symlink("..", pipelines.join("up")).expect("symlink");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    let billing = pipelines.join("billing.yaml");
    fs::write(&billing, "version: 1\n").expect("write");
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![billing]);
}

#[tokio::test]
async fn set_paths_moves_the_watches() {
    let _sighup = SIGHUP.read().await;
    let (dir, pipelines) = project();
    let schemas = dir.path().join("schemas");
    fs::create_dir(&schemas).expect("mkdir");
    let order = schemas.join("order.json");
    fs::write(&order, "{}").expect("write");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    reloads.set_paths(vec![order.clone()]);
    fs::write(pipelines.join("orders.yaml"), "version: 1\n# unwatched now\n").expect("write");
    save_by_rename(&order, r#"{"type": "object"}"#);
    assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![order]);
}

/// Issue 19, item 10: fifty editor saves a second held every request back until they stopped.
/// Under a continuous stream of saves a request still comes at least once a second, and one
/// comes after the last save, so that it is applied.
#[tokio::test]
async fn fifty_saves_a_second_still_ask_for_a_reload_every_second() {
    let _sighup = SIGHUP.read().await;
    let (_dir, pipelines) = project();
    let orders = pipelines.join("orders.yaml");
    let mut reloads = spawn(vec![pipelines.clone()], true).expect("spawn");

    let mut writer = tokio::spawn({
        let orders = orders.clone();
        async move {
            let started = Instant::now();
            let (mut save, mut last) = (0, started);
            while started.elapsed() < Duration::from_secs(3) {
                save += 1;
                save_by_rename(&orders, &format!("version: 1\n# save {save}\n"));
                // When the last save was made, not when the writer ended: a request taken in
                // between reads it.
                last = Instant::now();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            last
        }
    });
    let mut taken = Vec::new();
    let last_save = loop {
        tokio::select! {
            done = &mut writer => break done.expect("writer"),
            trigger = reloads.next() => {
                assert_eq!(trigger, Some(Trigger::Files(vec![orders.clone()])));
                taken.push(Instant::now());
            }
        }
    };
    assert!(taken.len() >= 2, "{} request(s) during three seconds of saves", taken.len());
    // A request taken after the last save reads what it saved.
    if taken.last().is_none_or(|t| *t < last_save) {
        assert_eq!(files(next_within(&mut reloads, WITHIN).await), vec![orders]);
    }
}
