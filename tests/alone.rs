//! The tests that need the machine to themselves, one binary (`cargo test --test alone`) that
//! cargo runs after the suite, its tests one at a time: what they measure bends when other
//! tests share the two cores (beside the suite, the cluster's recoveries and the adaptive
//! limit missed their bounds).

#[macro_use]
mod support;

mod adaptive;
mod cluster;

/// Each test holds this while it runs.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
