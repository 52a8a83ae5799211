//! The kit for brokers that keep their own messages (embedded, Redis, and those to come):
//! what they deliver ([`kept`]), one claim loop driven by a small trait ([`claim`]), when to
//! renew leases ([`lease`]), the topology they route on ([`topology`]), how they store headers
//! ([`headers`]), and, for a broker that confirms a position (an offset log, AMQP's `multiple`
//! ack), which settled deliveries it can confirm ([`AckWindow`]).
//!
//! The kit owns what these brokers share of delivery and routing; it must not touch any
//! broker's storage (no SQL, no Redis command): each part is driven by what its broker reads
//! and writes.

mod ack_window;
pub mod carried;
pub mod claim;
pub mod headers;
pub mod kept;
pub mod lease;
pub mod topology;

use std::sync::{Mutex, MutexGuard};

pub use self::ack_window::AckWindow;

/// Locks `m`; what it guards is left whole between its uses, panic or not.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
