//! Handlers: what runs for each message (an HTTP webhook or a subprocess), the templates that
//! shape their requests, and the classification of their results.

pub mod template;
