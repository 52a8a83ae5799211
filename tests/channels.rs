//! Issue 19 (item 11, on RabbitMQ): a runner consumes each queue on a channel of its own, and a
//! connection has at most `channel_max` channels (2,047 on RabbitMQ by default, so 5,000 queues
//! did not fit one connection). Past that, the runner opens another connection for consumers.
//! The test asks for `channel_max=8` in the URL, so 20 queues need three connections.

use crate::support;

use std::time::Duration;

use support::{Receiver, Sluice, Vhost};

#[tokio::test(flavor = "multi_thread")]
async fn queues_beyond_one_connections_channels_are_consumed_on_another() {
    let vhost = Vhost::new();
    let url = format!("{}?channel_max=8", vhost.url());
    let receiver = Receiver::ok().await;
    let queues = 20;
    let mut yaml = String::from("version: 1\nexchanges:\n  ev: {type: direct}\nqueues:\n");
    for n in 0..queues {
        yaml.push_str(&format!(
            "  q{n}:\n    type: classic\n    bind: [{{exchange: ev, routing_key: q{n}}}]\n    handler:\n      webhook: {{url: \"{}/q{n}\"}}\n",
            receiver.uri()
        ));
    }
    let dir = support::pipeline(&yaml);
    let broker = vhost.connect().await;
    support::declare(dir.path(), &broker).await;
    for n in 0..queues {
        let body =
            sluice::envelope::Envelope::new("t", &serde_json::json!({"queue": n}), Some(format!("k{n}"))).encode();
        support::publish_raw(&broker, "ev", &format!("q{n}"), body, Default::default()).await;
    }
    let mut sluice = Sluice::run(dir.path(), &url, &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(120)), Some(0), "{}", sluice.log());
    let keys = receiver.succeeded_keys();
    assert_eq!(keys.len(), queues, "every queue's message handled once: {keys:?}\n{}", sluice.log());
}
