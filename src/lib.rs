//! sluice: declarative message pipelines. YAML files in, RabbitMQ topology and workers out.
//!
//! Data flows left to right through the modules: `config` → `topology` → `broker` →
//! `runtime` → `handler`, with `cli` a thin layer on top; `trace` carries trace context across
//! them.

pub mod admin;
pub mod broker;
pub mod cli;
pub mod config;
pub mod dedup;
pub mod envelope;
pub mod handler;
pub mod ops;
pub mod reload;
pub mod runtime;
pub mod testing;
pub mod topology;
pub mod trace;
