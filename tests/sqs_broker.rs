//! The SQS broker end to end, on the suite's emulator (moto): the shared scenarios that matter
//! most on it (routing, retries, poison messages, the dead-letter tools; `leased.rs` has kill
//! -9 and two runners), run here rather than through `on_every_broker!` because moto answers
//! a request in 10–30 ms; and what only SQS does: a lease extended past the visibility timeout,
//! and a message its redrive policy moved.

use crate::support;

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_reaches_every_bound_queue() {
    crate::run_behaviour::fan_out_delivers_once_per_bound_queue(SqsPrefix::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_run_exactly_max_attempts_then_dead_letter() {
    crate::run_retries::retry_exhaustion_calls_exactly_max_attempts_then_dead_letters(SqsPrefix::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_go_to_the_dead_letter_queue_at_once() {
    crate::failure_injection::poison_messages_are_dead_lettered_at_once_and_the_next_message_is_processed(
        SqsPrefix::new(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_and_redriven() {
    crate::dlq::messages_dead_lettered_while_the_receiver_was_down_run_once_each_after_a_redrive(SqsPrefix::new())
        .await;
}
