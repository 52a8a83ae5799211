//! sluice: declarative message pipelines. YAML files in, RabbitMQ topology and workers out.
//!
//! Data flows left to right through the modules: `config` → `topology` → `broker` →
//! `runtime` → `handler`, with `app` (the one place a broker is assembled) and `cli` (a thin
//! layer of arguments and output) on top; `vocab` holds the words config and the brokers share,
//! below both; `trace` carries trace context across them.

pub mod admin;
pub mod app;
pub mod backoff;
pub mod broker;
pub mod call;
pub mod cli;
pub mod config;
pub mod dedup;
pub mod envelope;
pub mod file;
pub mod format;
pub mod handler;
pub mod ops;
pub mod reload;
pub mod runtime;
pub mod secret;
pub mod terminal;
pub mod testing;
pub mod topology;
pub mod trace;
pub mod vocab;

/// Makes ring the process's TLS crypto provider (rustls is built with ring alone, for lapin and
/// reqwest both: aws-lc's C build cost five times ring's CPU). reqwest needs it installed before
/// it builds a client; installing it again is harmless.
pub fn install_tls_provider() {
    // Err only when a provider is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
