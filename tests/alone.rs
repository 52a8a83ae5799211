//! The test that needs the machine to itself, a binary of its own (`cargo test --test alone`)
//! that `.ci/run` runs last, when nothing else runs: what adaptive concurrency reaches bends
//! when other tests share the two cores (beside the suite, its limit sank to 11 and overshot
//! to 32 in turns).

#[macro_use]
mod support;

mod adaptive;
