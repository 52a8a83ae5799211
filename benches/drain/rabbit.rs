//! A RabbitMQ trial's vhost: made and removed with rabbitmqctl, as the integration tests do.

use std::process::Command;

use anyhow::{Context as _, bail};

fn rabbitmqctl(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("rabbitmqctl").args(args).output().context("cannot run rabbitmqctl")?;
    if !out.status.success() {
        bail!("rabbitmqctl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A vhost of its own for one trial; deleted on drop unless kept.
pub struct Vhost {
    pub name: String,
    kept: bool,
}

impl Vhost {
    pub fn new() -> anyhow::Result<Vhost> {
        let name = format!("sluice-bench-{}", uuid::Uuid::now_v7());
        rabbitmqctl(&["add_vhost", &name])?;
        let vhost = Vhost { name, kept: false };
        rabbitmqctl(&["set_permissions", "-p", &vhost.name, "guest", ".*", ".*", ".*"])?;
        Ok(vhost)
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:5672/{}", self.name)
    }

    /// Leaves the vhost on the broker, for looking into a failed trial.
    pub fn keep(&mut self) {
        self.kept = true;
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        if !self.kept {
            let _ = rabbitmqctl(&["delete_vhost", &self.name]);
        }
    }
}
