//! The integration tests, one binary (as ripgrep and cargo have them): each file beside this one
//! is a module, linked once against sluice and its C libraries instead of once per file. Run
//! one file's tests with `cargo test --test suite FILE::` (e.g. `cargo test --test suite dlq::`).
//! `cluster.rs` is the binary `cluster` (`cargo test --test cluster`), which `.ci/run` runs
//! beside the suite (and after it, this binary's `schedule::` and `redis_broker::`, which the
//! suite run there leaves out), and `adaptive.rs` the binary `alone`, run last with the machine
//! to itself: beside the suite, the adaptive limit missed its bounds.

#[macro_use]
mod support;
mod util;

mod admin;
mod admin_exposure;
mod admin_guard;
mod admin_load;
mod broker_arguments;
mod capabilities;
mod channels;
mod cli;
mod cli_publish;
mod cli_run;
mod command;
mod conformance;
mod console;
mod damaged;
mod dlq;
mod downstream;
mod embedded;
mod embedded_liveness;
mod env_interpolation;
mod failure_injection;
mod filters;
mod footguns;
mod formats;
mod hardening;
mod hostile;
mod hostile_handlers;
mod hostile_tree;
mod idempotency;
mod jetstream_broker;
mod large_messages;
mod leased;
mod log_hygiene;
mod logs;
mod monitoring;
mod ordering;
mod outbound_auth;
mod overlapping_acks;
mod packaging;
mod readme;
mod readonly;
mod redis_broker;
mod redis_server;
mod reload;
mod reload_concurrency;
mod reload_links;
mod reload_unbind;
mod run_behaviour;
mod run_env;
mod run_retries;
mod schedule;
mod signing;
mod sluice_test;
mod sqs_aws;
mod sqs_broker;
mod test_hygiene;
mod trace;
mod validation;
mod webhook;
