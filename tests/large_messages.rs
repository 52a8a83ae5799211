//! Large messages and memory on the embedded broker (issue 19.7): `publish` refuses what no
//! queue would accept without holding it, streams `--jsonl`, and `run` dead-letters a message
//! over its queue's `max_message_bytes` without reading its body. Each bound is generous (the
//! figures are in BENCHMARKS.md, "Large messages: memory"); before, each was several times it.

use crate::support;

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use sluice::envelope::Envelope;
use support::*;

/// A pipeline whose queue `work` (bound to `ev`) keeps the default limit, 16 MiB.
fn pipeline_with_default_limit() -> tempfile::TempDir {
    work_pipeline("    handler: {command: {program: /bin/true}}\n")
}

/// `sluice ARGS --broker URL`, to completion.
fn cli(args: &[&str], place: &EmbeddedDir) -> Finished {
    let url = place.url();
    let all: Vec<&str> = args.iter().copied().chain(["--broker", url.as_str()]).collect();
    sluice_cli(&all, &[], Duration::from_secs(300))
}

fn mib(kib: u64) -> u64 {
    kib / 1024
}

/// Issue 19.7: a 300 MB payload, over the limit of the only queue it would reach, is refused
/// by `publish` naming the queue and its limit, without being read whole. (It took `publish`
/// to 1.26 GB and was published.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_refuses_a_message_no_queue_would_accept_without_holding_it() {
    let place = EmbeddedDir::new();
    let dir = pipeline_with_default_limit();
    declare(dir.path(), &place.connect().await).await;
    let payload = dir.path().join("big.json");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&payload).expect("create"));
    write_blob(&mut file, 300);
    file.flush().expect("flush");
    drop(file);

    let payload = payload.display().to_string();
    let args = ["publish", "--exchange", "ev", "--routing-key", "k", "--type", "t", "--payload-file", &payload];
    let done = cli(&args, &place);
    assert_eq!(done.code, Some(1), "stderr: {}", done.stderr);
    assert!(done.stderr.contains("\"work\" takes 16777216"), "names the queue and its limit: {}", done.stderr);
    assert_eq!(place.depth("work").await, 0, "nothing published");
    assert!(mib(done.peak_rss_kib) < 150, "publish peaked at {} MiB", mib(done.peak_rss_kib));
}

/// Writes `{"blob": "xxx…"}` with `mb` million x's to `out`.
fn write_blob(out: &mut impl std::io::Write, mb: usize) {
    out.write_all(b"{\"blob\": \"").expect("write");
    for _ in 0..mb {
        out.write_all(&[b'x'; 1_000_000]).expect("write");
    }
    out.write_all(b"\"}").expect("write");
}

/// Issue 31 (left by round 3): a 100 MB line of a `--jsonl` file, over the limit of the only
/// queue it would reach, is refused naming its line and the queue's limit, without being read
/// whole: nothing is published, and memory holds at most the limit's worth of it. (The line
/// was read whole, parsed and encoded before the refusal: 483 MB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_jsonl_refuses_a_line_over_the_limit_without_reading_it_whole() {
    let place = EmbeddedDir::new();
    let dir = pipeline_with_default_limit();
    declare(dir.path(), &place.connect().await).await;
    let path = dir.path().join("lines.jsonl");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).expect("create"));
    file.write_all(b"{\"n\": 1}\n").expect("write");
    write_blob(&mut file, 100);
    file.write_all(b"\n{\"n\": 3}\n").expect("write");
    file.flush().expect("flush");
    drop(file);

    let path = path.display().to_string();
    let done = cli(&["publish", "--exchange", "ev", "--routing-key", "k", "--type", "t", "--jsonl", &path], &place);
    assert_eq!(done.code, Some(1), "stderr: {}", done.stderr);
    assert!(
        done.stderr.contains(&format!("{path}:2")) && done.stderr.contains("\"work\" takes 16777216"),
        "names the line, the queue and its limit: {}",
        done.stderr
    );
    assert_eq!(place.depth("work").await, 0, "nothing published");
    assert!(mib(done.peak_rss_kib) < 100, "publish --jsonl peaked at {} MiB", mib(done.peak_rss_kib));
}

/// Issue 31 (left by round 3): a 100 MB message that its queue takes is published whole
/// within about twice its size in memory. (`publish` held the payload parsed, the envelope,
/// the body and a copy of it for the broker at once: 605 MB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_of_a_large_message_holds_it_about_twice() {
    let place = EmbeddedDir::new();
    let dir = work_pipeline("    max_message_bytes: 200MiB\n    handler: {command: {program: /bin/true}}\n");
    declare(dir.path(), &place.connect().await).await;
    let payload = dir.path().join("big.json");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&payload).expect("create"));
    write_blob(&mut file, 100);
    file.flush().expect("flush");
    drop(file);

    let payload = payload.display().to_string();
    let args = ["publish", "--exchange", "ev", "--routing-key", "k", "--type", "t", "--payload-file", &payload];
    let done = cli(&args, &place);
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);
    let db = rusqlite::Connection::open(Path::new(&place.url()).join(sluice::broker::embedded::FILE)).expect("open");
    let length: i64 = db
        .query_row(
            "SELECT length(b.data) FROM messages m JOIN bodies b ON b.id = m.body WHERE m.queue = 'work'",
            [],
            |r| r.get(0),
        )
        .expect("the message");
    assert!(length > 100_000_000, "the whole body: {length} bytes");
    assert!(mib(done.peak_rss_kib) < 300, "publish peaked at {} MiB", mib(done.peak_rss_kib));
}

/// Issue 19.7: `publish --jsonl` holds a batch, not the file: 100,000 lines, all published,
/// within twice the process's base of about 40 MiB. (Holding the file took 587 MiB for 300,000
/// lines; a third as many would still take about 200, and publish in a third of the time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_jsonl_streams_the_file() {
    let place = EmbeddedDir::new();
    let dir = pipeline_with_default_limit();
    declare(dir.path(), &place.connect().await).await;
    let lines = 100_000;
    let path = dir.path().join("lines.jsonl");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).expect("create"));
    for n in 0..lines {
        writeln!(file, "{{\"n\": {n}, \"text\": \"a line of a bulk publish\"}}").expect("write");
    }
    file.flush().expect("flush");
    drop(file);

    let path = path.display().to_string();
    let done = cli(&["publish", "--exchange", "ev", "--routing-key", "k", "--type", "t", "--jsonl", &path], &place);
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);
    assert_eq!(place.depth("work").await, lines);
    assert!(mib(done.peak_rss_kib) < 80, "publish --jsonl peaked at {} MiB", mib(done.peak_rss_kib));
}

/// Issue 19.7: `run` dead-letters a 100 MB message over its queue's limit as `too_large`
/// without reading its body, and the dead-letter copy keeps the whole body. (The runner read
/// it, and copied it: 525 MB; one of 300 MB, 1.35 GB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_dead_letters_a_message_over_the_limit_without_reading_it() {
    let place = EmbeddedDir::new();
    let dir = pipeline_with_default_limit();
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let envelope = Envelope::new("t", &json!({"blob": "x".repeat(100_000_000)}), Some("large".into()));
    let body = envelope.encode();
    let size = body.len();
    drop(envelope);
    publish_raw(&broker, "ev", "k", body, Default::default()).await;
    drop(broker);

    let (dirs, dedup) = (dir.path().display().to_string(), dir.path().join("dedup").display().to_string());
    let done = cli(&["run", &dirs, "--exit-when-idle", "--dedup", &dedup], &place);
    assert_eq!(done.code, Some(0), "stderr: {}", done.stderr);
    assert_eq!(place.depth("work").await, 0);
    let db = rusqlite::Connection::open(Path::new(&place.url()).join(sluice::broker::embedded::FILE)).expect("open");
    let (headers, length): (String, i64) = db
        .query_row(
            "SELECT m.headers, length(b.data) FROM messages m JOIN bodies b ON b.id = m.body WHERE m.queue = 'work.dlq'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("the dead-letter copy");
    assert!(headers.contains("\"x-sluice-reason\":\"too_large\""), "{headers}");
    assert_eq!(usize::try_from(length).expect("length"), size, "the whole body kept");
    assert!(mib(done.peak_rss_kib) < 150, "run peaked at {} MiB", mib(done.peak_rss_kib));
}
