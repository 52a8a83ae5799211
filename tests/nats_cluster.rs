//! Issue 35: sluice on a three-node NATS cluster with JetStream of the test's own
//! (tests/support/nats_cluster.rs), R3 streams, a real `sluice run` given every node's URL
//! under a steady confirmed stream; then a node killed with `kill -9` (the one sluice is
//! connected to, or the queue's stream leader) or frozen with SIGSTOP for 30 s. Each scenario
//! counts, by idempotency key, what reached the receiver: every confirmed key handled, none
//! handled twice, and the longest pause between two webhook calls, printed (never asserted:
//! timings are the machine's; the goals are in BENCHMARKS.md).
//!
//! Each scenario has a cluster of its own (one starts in about a second). A binary of its own
//! (`cargo test --test nats_cluster`): it waits on nodes and a stream, not on the cores.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[macro_use]
mod support;

use crate::support::nats_cluster::NatsCluster;
use crate::support::stream::{Outcome, Stream};
use crate::support::*;
use sluice::broker::Broker as _;
use sluice::broker::jetstream::JetStream;

/// The name prefix of every scenario (each has a cluster of its own).
const PREFIX: &str = "t";

/// The stream of the pipeline's queue `work`: `PREFIX_q_` and the name in hex.
const WORK_STREAM: &str = "t_q_776f726b";

/// Waits until every confirmed key was handled (two minutes at most); counts what it finds.
async fn outcome(receiver: &Receiver, confirmed: &BTreeMap<String, Instant>, from: Instant) -> Outcome {
    let start = Instant::now();
    loop {
        let handled = receiver.succeeded_keys();
        if confirmed.keys().all(|k| handled.contains(k)) || start.elapsed() > Duration::from_secs(120) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Outcome::count(receiver, confirmed, from)
}

/// What is done to the cluster once the runner consumes.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// kill -9 of the node sluice is connected to; started again after [`OUTAGE`].
    KillSluicesNode,
    /// kill -9 of the leader of the queue's stream; started again after [`OUTAGE`].
    KillTheStreamLeader,
    /// SIGSTOP of the node sluice is connected to for [`FREEZE`], then SIGCONT.
    FreezeSluicesNode,
}

/// How long a killed node stays down: several times the election that follows a kill, so a
/// new leader is elected and work goes on under it while the node is still away.
const OUTAGE: Duration = Duration::from_secs(5);

/// How long a frozen node stays stopped, as the issue says.
const FREEZE: Duration = Duration::from_secs(30);

/// How long the stream runs between the runner's first handled message and the fault: about
/// 100 messages at 100/s, so deliveries are in flight.
const AROUND: Duration = Duration::from_secs(1);

/// How many publishes the stream has confirmed with the node back before it stops.
const AFTER: usize = 200;

/// Runs blocking cluster steps without stalling the runtime's other tasks.
fn blocking<T>(step: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(step)
}

/// The node the runner has its connection with, once it has one (the first, if several).
async fn node_of(cluster: &NatsCluster, sluice: &Sluice) -> usize {
    let start = Instant::now();
    loop {
        if let Some(n) = cluster.nodes_of(sluice.child.id()).first() {
            return *n;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "sluice never connected; log:\n{}", sluice.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A cluster, a runner given every node's URL on a webhook pipeline with idempotency, a steady
/// stream of 100/s, and `fault` once the runner consumes: 0 confirmed messages lost, 0 handled
/// twice; the longest pause between webhook calls printed.
async fn under(fault: Fault) -> Outcome {
    let mut cluster = blocking(NatsCluster::start);
    let url = format!("{}?prefix={PREFIX}&lease=5s", cluster.url());
    let receiver = Receiver::ok().await;
    let dir = idempotent_pipeline(&receiver, 8);
    let broker = JetStream::connect(&url).await.expect("connect to the test's NATS cluster");
    declare(dir.path(), &broker).await;
    broker.close().await;
    let sluice = Sluice::run(dir.path(), &url, &[]);
    let node = node_of(&cluster, &sluice).await;
    let leader = blocking(|| cluster.stream_leader(WORK_STREAM));
    let target = match fault {
        Fault::KillSluicesNode | Fault::FreezeSluicesNode => node,
        Fault::KillTheStreamLeader => leader,
    };
    // Published through the other nodes: the stream goes on through the fault, as far as
    // the cluster takes it (a publish waits for the stream's leader).
    let published = format!("{}?prefix={PREFIX}", cluster.urls(&[target]).join(","));
    let stream = Stream::start(|u| async move { JetStream::connect(&u).await }, published, "k", 100);
    let start = Instant::now();
    while receiver.succeeded_keys().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(60), "nothing handled; log:\n{}", sluice.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(AROUND).await;
    let at = Instant::now();
    let mut elected = None;
    match fault {
        Fault::KillSluicesNode | Fault::KillTheStreamLeader => {
            cluster.kill(target);
            if target == leader {
                blocking(|| cluster.wait_for_another_leader(WORK_STREAM, leader));
                elected = Some(at.elapsed());
            }
            tokio::time::sleep(OUTAGE.saturating_sub(at.elapsed())).await;
            blocking(|| cluster.restart(target));
        }
        Fault::FreezeSluicesNode => {
            cluster.freeze(target, true);
            tokio::time::sleep(FREEZE).await;
            cluster.freeze(target, false);
        }
    }
    // The stream goes on for a while with the node back.
    stream.confirmed_after(Instant::now(), AFTER).await;
    let confirmed = stream.stop().await;
    let outcome = outcome(&receiver, &confirmed, at).await;
    let Outcome { confirmed, lost, twice, pause, publishing } = &outcome;
    eprintln!(
        "{fault:?} (node {target}; sluice connected to {node}, stream leader {leader}, another elected after {elected:?}): {confirmed} confirmed, {lost} lost, {twice} handled twice, longest pause between webhook calls {pause:?}, between confirmed publishes {publishing:?}"
    );
    if outcome.lost > 0 {
        let detail = blocking(|| cluster.stream_detail(WORK_STREAM));
        panic!("confirmed keys never handled: {outcome:?}; the stream: {detail:#}\nlog:\n{}", sluice.log());
    }
    assert_eq!(outcome.twice, 0, "keys handled twice: {outcome:?}; log:\n{}", sluice.log());
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_of_the_node_sluice_is_connected_to() {
    under(Fault::KillSluicesNode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_of_the_stream_leader() {
    under(Fault::KillTheStreamLeader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_of_the_node_sluice_is_connected_to_for_30_s() {
    under(Fault::FreezeSluicesNode).await;
}
