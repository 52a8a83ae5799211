//! The tests leave nothing on the shared servers, even when a run is killed before its `Drop`s
//! run: what a test makes there is named by its process, and the next run deletes what a dead
//! process left.

use crate::support;

use support::{left_by_a_dead_run, owned_name};

/// This process, with a start time that is not its own: a process that no longer runs.
fn dead_owners_name() -> String {
    let this = sluice::broker::embedded::this_process();
    let [pid, start, namespace] = this.split(':').collect::<Vec<_>>()[..] else { panic!("pid:start:namespace") };
    let start: u64 = start.parse().expect("a start time");
    format!("sluice-test-{pid}-{}-{namespace}-{}", start + 1, uuid::Uuid::now_v7())
}

#[test]
fn names_tell_a_dead_runs_leftovers_from_a_live_ones() {
    assert!(!left_by_a_dead_run(&owned_name()), "this process runs");
    assert!(left_by_a_dead_run(&dead_owners_name()));
    // Names of other kinds, or of an earlier layout without the process, are never touched.
    assert!(!left_by_a_dead_run("sluice-test-01a2415a-775c-7204-9860-7a19de974087"));
    assert!(!left_by_a_dead_run("production"));
}

#[test]
fn a_vhost_a_dead_run_left_is_deleted_and_a_live_ones_is_kept() {
    support::require_rabbitmq();
    let live = support::Vhost::new();
    let dead = support::Vhost { name: dead_owners_name() };
    let made = std::process::Command::new("rabbitmqctl").args(["-q", "add_vhost", &dead.name]).status();
    assert!(made.is_ok_and(|s| s.success()), "add_vhost {}", dead.name);
    assert!(support::vhost_exists(&dead.name));
    support::delete_vhosts_of_dead_runs();
    assert!(!support::vhost_exists(&dead.name), "the dead run's vhost is gone");
    assert!(support::vhost_exists(&live.name), "a live run's vhost stays");
}
