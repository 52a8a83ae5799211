//! A Redis trial's key prefix, on the shared server at 127.0.0.1:6379 unless `--redis` names
//! another: every key the trial makes (the topology, the queue's stream, the idempotency keys)
//! starts with it, and all of them are deleted on drop, as a RabbitMQ trial's vhost is. The
//! server is shared, so the keys go by `SCAN` and `DEL` in batches, never one blocking `KEYS`;
//! `DEL`, not `UNLINK`, so that their memory is free before the next trial reads `used_memory`.

use anyhow::Context as _;

/// Keys a `SCAN` step looks at, and at most how many one `DEL` deletes.
const BATCH: usize = 1000;

/// A key prefix of its own for one trial; its keys deleted on drop unless kept.
pub struct Keyspace {
    /// The server, `redis://host:port`.
    server: String,
    pub prefix: String,
    kept: bool,
}

impl Keyspace {
    pub fn new(server: &str) -> Keyspace {
        Keyspace { server: server.to_string(), prefix: format!("bench-{}:", uuid::Uuid::now_v7()), kept: false }
    }

    /// What `sluice run --broker` takes: the idempotency keys go under the same prefix.
    pub fn url(&self) -> String {
        format!("{}/?prefix={}", self.server, self.prefix)
    }

    /// Leaves the keys on the server, for looking into a failed trial.
    pub fn keep(&mut self) {
        self.kept = true;
    }

    /// What the server uses now.
    pub fn usage(&self) -> anyhow::Result<Usage> {
        let info: String = redis::cmd("INFO").arg("memory").arg("cpu").query(&mut self.connect()?)?;
        let field = |name: &str| -> anyhow::Result<f64> {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse().ok())
                .with_context(|| format!("no {name} in INFO"))
        };
        Ok(Usage { memory: field("used_memory")? as u64, cpu: field("used_cpu_user")? + field("used_cpu_sys")? })
    }

    fn connect(&self) -> anyhow::Result<redis::Connection> {
        Ok(redis::Client::open(self.server.as_str())?.get_connection()?)
    }

    /// How many keys are under the prefix.
    pub fn count(&self) -> anyhow::Result<usize> {
        self.scan(|_, _| Ok(()))
    }

    /// Deletes every key under the prefix.
    fn delete(&self) -> anyhow::Result<()> {
        self.scan(|c, keys| Ok(redis::cmd("DEL").arg(keys).query::<()>(c)?)).map(|_| ())
    }

    /// Calls `each` with every batch of keys under the prefix; returns how many there were.
    fn scan(
        &self,
        mut each: impl FnMut(&mut redis::Connection, &[String]) -> anyhow::Result<()>,
    ) -> anyhow::Result<usize> {
        let mut c = self.connect()?;
        let (mut cursor, mut seen) = (0u64, 0);
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.prefix))
                .arg("COUNT")
                .arg(BATCH)
                .query(&mut c)?;
            if !keys.is_empty() {
                each(&mut c, &keys)?;
                seen += keys.len();
            }
            if next == 0 {
                return Ok(seen);
            }
            cursor = next;
        }
    }
}

impl Drop for Keyspace {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        if let Err(e) = self.delete() {
            eprintln!("cannot delete the keys under {}: {e:#}", self.prefix);
        }
    }
}

/// What the whole server uses, this trial's keys and clients and everyone else's.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    /// `used_memory` (`INFO memory`), bytes.
    pub memory: u64,
    /// `used_cpu_user` + `used_cpu_sys` (`INFO cpu`), seconds since the server started.
    pub cpu: f64,
}
