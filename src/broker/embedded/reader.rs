//! The embedded broker's file opened read-only, for the commands that only read (`sluice
//! status`, `sluice dlq list`, `sluice dlq show`): they never write to the file nor beside it,
//! so they work on a file this user may not write (a stopped runner's, kept for inspection),
//! and on a live runner's file they take no lease and register no consumer: its deliveries
//! keep their order and attempts. See [`Store::open_read_only`] for the snapshot they read
//! when SQLite cannot share the write-ahead log (a directory this user may not write).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use rusqlite::Connection;

use super::store::Store;
use super::{EmbeddedDelivery, FILE};
use crate::broker::kit::claim::CLAIM_MAX;
use crate::broker::kit::kept::CLAIM_BYTES;
use crate::broker::{BrokerError, QueueStats};

/// The broker's file, read-only.
pub struct ReadOnly {
    db: Connection,
    store: Store,
}

impl ReadOnly {
    /// Opens the file of the broker whose directory is `dir`, only if it is there.
    pub fn open_dir(dir: &Path) -> Result<ReadOnly, BrokerError> {
        let (db, store) = Store::open_read_only(&dir.join(FILE))?;
        Ok(ReadOnly { db, store })
    }

    /// Ready messages and live consumers (of every process) of `queue`.
    pub fn stats(&mut self, queue: &str) -> Result<QueueStats, BrokerError> {
        self.store.stats(&self.db, queue)
    }

    /// Messages not yet due back, in every queue (see [`Broker::delayed`](crate::broker::Broker::delayed)).
    pub fn delayed(&self) -> Result<u32, BrokerError> {
        self.store.delayed(&self.db)
    }

    /// The messages `queue` holds now (ready, delayed or leased), in their order, at most
    /// `most` of them; those that arrive later are not read.
    pub fn messages(&mut self, queue: &str, most: u32) -> Result<Messages<'_>, BrokerError> {
        self.stats(queue)?;
        let last = self.store.last_id(&self.db, queue)?;
        let held = self.store.count_up_to(&self.db, queue, last)?;
        Ok(Messages {
            reader: self,
            queue: queue.into(),
            after: 0,
            last,
            most,
            held,
            read: 0,
            dry: false,
            batch: VecDeque::new(),
        })
    }
}

/// A cursor over a queue's messages: batches of them read in id order, none taken.
pub struct Messages<'a> {
    reader: &'a ReadOnly,
    queue: String,
    /// The last id read, and the highest the queue had when the cursor began.
    after: i64,
    last: i64,
    most: u32,
    /// Messages the queue held when the cursor began, and those read since.
    held: u32,
    read: u32,
    /// Whether a read found no message left before `most` (those unread were removed).
    dry: bool,
    batch: VecDeque<EmbeddedDelivery>,
}

/// Why a cursor read fewer messages than its queue held when it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Short {
    /// It read its `most`.
    AtMost,
    /// The rest were removed meanwhile (taken by a runner, purged).
    Removed,
}

impl Messages<'_> {
    /// The next message, or none once all are read (or `most`).
    pub fn next_message(&mut self) -> Result<Option<EmbeddedDelivery>, BrokerError> {
        if self.read >= self.most {
            return Ok(None);
        }
        if self.batch.is_empty() {
            let ReadOnly { db, store } = self.reader;
            let n = u32::try_from(CLAIM_MAX).unwrap_or(u32::MAX).min(self.most - self.read);
            for stored in store.peek(db, &self.queue, (self.after, self.last), n, CLAIM_BYTES)? {
                self.after = stored.id;
                self.batch.push_back(super::delivery(stored, Arc::new(AtomicBool::new(true))));
            }
        }
        let next = self.batch.pop_front();
        self.read += u32::from(next.is_some());
        self.dry |= next.is_none();
        Ok(next)
    }

    /// Messages the queue held when the cursor began that it did not read, and why, unless its
    /// reader stopped asking first.
    pub fn unread(&self) -> (u32, Option<Short>) {
        let unread = self.held.saturating_sub(self.read);
        let why = match (self.read >= self.most, self.dry) {
            (true, _) => Some(Short::AtMost),
            (false, true) => Some(Short::Removed),
            (false, false) => None,
        };
        (unread, why.filter(|_| unread > 0))
    }
}
