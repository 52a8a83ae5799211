//! What the logs must never hold, whatever `RUST_LOG` asks for: the broker password.

use crate::support;

use std::time::Duration;

use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// Issue 19: `RUST_LOG=trace` printed the AMQP PLAIN credentials (lapin traces the
/// connection.start-ok frame, whose response is `\0guest\0guest`, as bytes) and the URL with
/// its password (amq-protocol traces the URI it connects to).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_logs_never_show_the_broker_password() {
    let vhost = Vhost::new();
    let dir = pipeline(
        r##"version: 1
exchanges: {ev: {type: topic}}
queues:
  inbox:
    bind: [{exchange: ev, routing_key: "#"}]
    handler: {command: {program: /bin/true}}
"##,
    );
    declare(dir.path(), &vhost.connect().await).await;
    let url = vhost.url();
    let run = sluice_cli(
        &["publish", "--broker", &url, "--exchange", "ev", "--routing-key", "k", "--type", "t", "--payload", "{}"],
        &[("RUST_LOG", "trace")],
        DEADLINE,
    );
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(drain_messages(&url, "inbox").await.len(), 1, "the message did not land");
    // The password in a URL, the PLAIN response `\0guest\0guest` as text (raw or escaped)
    // and the bytes of "guest" as a `Debug` of bytes renders them.
    for secret in ["guest:guest", "\0guest\0guest", "\\0guest", "\\u{0}guest", "103, 117, 101, 115, 116"] {
        assert!(!run.stderr.contains(secret), "{secret:?} in the log:\n{}", run.stderr);
    }
}
