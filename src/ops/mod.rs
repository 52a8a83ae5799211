//! What operators do to a running deployment from the command line: read and redrive
//! dead-letter queues, see every queue at a glance. Generic over the broker, so the same
//! commands work on RabbitMQ and on the embedded broker; the CLI prints what these return.

pub mod dlq;
pub mod status;
