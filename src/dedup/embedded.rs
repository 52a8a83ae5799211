//! The embedded store: the idempotency keys in the embedded broker's SQLite file (see
//! `broker::embedded::keys`). With the embedded broker it is the broker's own file, and a
//! runner's completed keys are written in the transaction that acks their messages; with
//! RabbitMQ it is a file of its own, written just before the acks. Several processes may
//! share it: two runners on one state directory see each other's keys and claims (a runner
//! alone keeps its claims in memory until another registers beside it).

use std::path::Path;
use std::time::Duration;

use super::{Claim, StoreError};
use crate::broker::BrokerError;
use crate::broker::embedded::Embedded;

/// The embedded idempotency store.
#[derive(Clone)]
pub struct EmbeddedStore {
    broker: Embedded,
    /// The runner's broker is this file: keys ride on the acks.
    rides_acks: bool,
}

fn err(e: BrokerError) -> StoreError {
    StoreError { message: e.to_string(), damaged: e.is_damaged() }
}

impl EmbeddedStore {
    /// Opens (creating) the state directory `dir`'s file, beside a RabbitMQ broker.
    pub fn open(dir: &Path) -> Result<EmbeddedStore, StoreError> {
        Ok(EmbeddedStore { broker: Embedded::open_dir(dir).map_err(err)?, rides_acks: false })
    }

    /// The store in the runner's own embedded broker.
    pub fn in_broker(broker: &Embedded) -> EmbeddedStore {
        EmbeddedStore { broker: broker.clone(), rides_acks: true }
    }

    pub fn rides_acks(&self) -> bool {
        self.rides_acks
    }

    pub async fn claim(&self, key: &str, lease: Duration) -> Result<Claim, StoreError> {
        self.broker.claim_key(key, lease).await.map_err(err)
    }

    pub async fn complete(&self, keys: &[String], ttl: Duration) -> Result<(), StoreError> {
        self.broker.complete_keys(keys, ttl).await.map_err(err)
    }

    pub async fn release(&self, key: &str) -> Result<(), StoreError> {
        self.broker.release_key(key).await.map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn store() -> (tempfile::TempDir, EmbeddedStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EmbeddedStore::open(&dir.path().join("state")).expect("open");
        (dir, store)
    }

    #[tokio::test]
    async fn claim_complete_release_cycle() {
        let (_dir, s) = store();
        assert_eq!(s.claim("k", MINUTE).await.unwrap(), Claim::Claimed);
        assert_eq!(s.claim("k", MINUTE).await.unwrap(), Claim::Busy, "another handler of this process");
        s.release("k").await.unwrap();
        assert_eq!(s.claim("k", MINUTE).await.unwrap(), Claim::Claimed);
        s.complete(&["k".into()], MINUTE).await.unwrap();
        assert_eq!(s.claim("k", MINUTE).await.unwrap(), Claim::Done);
        // release never undoes a completion
        s.release("k").await.unwrap();
        assert_eq!(s.claim("k", MINUTE).await.unwrap(), Claim::Done);
        let batch = ["a".to_string(), "b".to_string()];
        for key in &batch {
            assert_eq!(s.claim(key, MINUTE).await.unwrap(), Claim::Claimed);
        }
        s.complete(&batch, MINUTE).await.unwrap();
        for key in &batch {
            assert_eq!(s.claim(key, MINUTE).await.unwrap(), Claim::Done);
        }
    }

    /// Claims made together are read together, each answered for its own key; a claim whose
    /// task ends while it leads a read still answers the others.
    #[tokio::test]
    async fn claims_made_together_are_each_answered() {
        use futures_util::FutureExt as _;
        let (_dir, s) = store();
        assert_eq!(s.claim("warm-up", MINUTE).await.unwrap(), Claim::Claimed);
        s.complete(&["done-1".into(), "done-7".into()], MINUTE).await.unwrap();
        let keys: Vec<String> = (0..10).map(|i| format!("done-{i}")).collect();
        let answers = futures_util::future::join_all(keys.iter().map(|k| s.claim(k, MINUTE))).await;
        for (key, answer) in keys.iter().zip(answers) {
            let want = if key == "done-1" || key == "done-7" { Claim::Done } else { Claim::Claimed };
            assert_eq!(answer.unwrap(), want, "{key}");
        }
        let (mut first, mut second) = (Box::pin(s.claim("dropped", MINUTE)), Box::pin(s.claim("done-1", MINUTE)));
        assert!(first.as_mut().now_or_never().is_none(), "the first waits for others to join its read");
        assert!(second.as_mut().now_or_never().is_none(), "the second joins it");
        drop(first);
        let answered = tokio::time::timeout(MINUTE, second).await.expect("the second is answered");
        assert_eq!(answered.unwrap(), Claim::Done);
    }

    #[tokio::test]
    async fn expired_leases_and_keys_can_be_claimed_again() {
        let (_dir, s) = store();
        assert_eq!(s.claim("lease", Duration::from_millis(1)).await.unwrap(), Claim::Claimed);
        s.complete(&["done".into()], Duration::from_millis(1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(s.claim("lease", MINUTE).await.unwrap(), Claim::Claimed);
        assert_eq!(s.claim("done", MINUTE).await.unwrap(), Claim::Claimed);
    }

    #[tokio::test]
    async fn completions_survive_reopening_and_two_handles_share_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = EmbeddedStore::open(dir.path()).expect("open");
        let second = EmbeddedStore::open(dir.path()).expect("a second runner opens it too");
        first.complete(&["done".into()], MINUTE).await.unwrap();
        assert_eq!(second.claim("done", MINUTE).await.unwrap(), Claim::Done);
        drop((first, second));
        let again = EmbeddedStore::open(dir.path()).expect("open");
        assert_eq!(again.claim("done", MINUTE).await.unwrap(), Claim::Done);
    }
}
