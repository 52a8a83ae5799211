//! Issue 23: the broker contract lets `ack` calls on one consumer overlap. On RabbitMQ an ack
//! for a tag that a later `multiple` ack already covered closes the channel, so a consumer
//! whose overlapping calls could send them out of order lost its channel and every unacked
//! delivery on it. Many concurrent single acks, in scrambled order, must each succeed once.

use crate::support;

use std::time::Duration;

use futures_util::StreamExt as _;
use rand::seq::SliceRandom as _;
use sluice::broker::{Broker, Consumer as _, Credit};

use support::{Vhost, declare, publish, wait_until, work_pipeline};

const N: usize = 400;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_acks_on_one_consumer_keep_its_channel_and_ack_each_message_once() {
    let vhost = Vhost::new();
    let dir = work_pipeline("    handler: {webhook: {url: \"http://127.0.0.1:9/x\"}}\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..N {
        publish(&broker, "ev", "k", &format!("key-{i}"), serde_json::json!({ "i": i })).await;
    }
    let prefetch = u16::try_from(N).expect("fits");
    let (mut deliveries, consumer) = broker.consume("work", Credit::at_most(prefetch)).await.expect("consume");
    let mut held = Vec::new();
    while held.len() < N {
        let next = tokio::time::timeout(Duration::from_secs(10), deliveries.next()).await;
        held.push(next.expect("a delivery in time").expect("stream open").expect("a delivery"));
    }
    held.shuffle(&mut rand::rng());
    let acks: Vec<_> = held
        .into_iter()
        .map(|delivery| {
            let consumer = consumer.clone();
            tokio::spawn(async move { consumer.ack(std::slice::from_ref(&delivery)).await })
        })
        .collect();
    let mut failed = Vec::new();
    for ack in acks {
        if let Err(e) = ack.await.expect("ack task") {
            failed.push(e.to_string());
        }
    }
    assert!(failed.is_empty(), "{} of {N} acks failed, first: {:?}", failed.len(), failed.first());
    // Cancel-ok comes back on the consumer's channel after every ack sent before it: an open
    // channel that has taken every ack. A bad ack would have closed it.
    consumer.cancel().await.expect("the consumer's channel is still open");
    consumer.close().await;
    // Whatever was not acked goes back to the queue with the channel.
    wait_until(Duration::from_secs(10), "the consumer gone", || async {
        broker.stats("work").await.is_ok_and(|s| s.consumers == 0)
    })
    .await;
    assert_eq!(broker.depth("work").await.expect("depth"), 0, "every message acked");
}
