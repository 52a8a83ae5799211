//! Hot reload through symbolic links (issue 19, item 8), against real RabbitMQ and the real
//! binary: a Kubernetes ConfigMap update (kubelet's `..data` symlink swap) and edits behind a
//! pipeline directory that is a symbolic link are applied. What a reload did is read from the
//! receivers: a message published after it reaches the new handler, not the old one.

use crate::support;

use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use sluice::broker::amqp::Amqp;
use support::*;

const DEADLINE: Duration = Duration::from_secs(20);
const APPLIED: &str = "sluice_config_reloads_total{result=\"applied\"}";

/// Waits until the runner at `admin` has applied `n` reloads.
async fn wait_applied(admin: &str, n: f64) {
    let what = format!("{APPLIED} >= {n}");
    wait_until(DEADLINE, &what, || async { sample(admin, APPLIED).await.is_some_and(|v| v >= n) }).await;
}

/// Publishes `key` and waits until `now` handled it; `before` must not have been called for it.
async fn handled_by(broker: &Amqp, key: &str, now: &Receiver, before: &Receiver) {
    publish(broker, "ev", "any", key, json!({})).await;
    let what = format!("a call for {key:?} at the new receiver");
    wait_until(DEADLINE, &what, || async { now.hits_for(key).iter().any(Hit::succeeded) }).await;
    assert!(before.hits_for(key).is_empty(), "{key:?} also went to the old receiver");
}

/// Writes the files of one ConfigMap version into `mount/..<timestamp>/` and makes it the
/// current one as kubelet's AtomicWriter does: a new `..data_tmp` link to it renamed over
/// `..data`, then the old version's directory removed. Each key is a link `KEY ->
/// ..data/KEY`, made once.
fn configmap_version(mount: &Path, timestamp: &str, files: &[(&str, &str)]) {
    let version = format!("..{timestamp}");
    std::fs::create_dir(mount.join(&version)).expect("mkdir version");
    for (name, text) in files {
        std::fs::write(mount.join(&version).join(name), text).expect("write version file");
    }
    let old = std::fs::read_link(mount.join("..data")).ok();
    symlink(&version, mount.join("..data_tmp")).expect("symlink ..data_tmp");
    std::fs::rename(mount.join("..data_tmp"), mount.join("..data")).expect("rename ..data_tmp over ..data");
    for (name, _) in files {
        let key = mount.join(name);
        if std::fs::symlink_metadata(&key).is_err() {
            symlink(Path::new("..data").join(name), key).expect("symlink key");
        }
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(mount.join(old)).expect("remove old version");
    }
}

/// Issue 19: a ConfigMap update (the `..data` symlink swap) went unseen and the runner kept the
/// old config silently. The new version's pipeline is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_is_applied() {
    let vhost = Vhost::new();
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let root = tempfile::tempdir().expect("tempdir");
    let mount = root.path().join("config");
    std::fs::create_dir(&mount).expect("mkdir mount");
    configmap_version(&mount, "2026_12_02_01_00_00.123", &[("orders.yaml", &webhook_yaml(&a, ""))]);
    let broker = vhost.connect().await;
    let (_sluice, admin) = run_with_admin(&mount, &vhost.url(), "work").await;
    handled_by(&broker, "before", &a, &b).await;

    configmap_version(&mount, "2026_12_02_01_05_00.456", &[("orders.yaml", &webhook_yaml(&b, ""))]);
    wait_applied(&admin, 1.0).await;
    handled_by(&broker, "after", &b, &a).await;
}

/// Issue 19: an edit behind a pipeline directory that is a symbolic link went unseen. Edits in
/// the directory it points to are applied, and so is the link pointed elsewhere, and edits there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_behind_a_linked_pipeline_directory_are_applied() {
    let vhost = Vhost::new();
    let (a, b, c) = (Receiver::ok().await, Receiver::ok().await, Receiver::ok().await);
    let root = tempfile::tempdir().expect("tempdir");
    let (first, second, pipelines) =
        (root.path().join("first"), root.path().join("second"), root.path().join("pipelines"));
    for dir in [&first, &second] {
        std::fs::create_dir(dir).expect("mkdir");
    }
    std::fs::write(first.join("orders.yaml"), webhook_yaml(&a, "")).expect("write");
    std::fs::write(second.join("orders.yaml"), webhook_yaml(&c, "")).expect("write");
    symlink(&first, &pipelines).expect("symlink pipelines");
    let broker = vhost.connect().await;
    let (_sluice, admin) = run_with_admin(&pipelines, &vhost.url(), "work").await;
    handled_by(&broker, "before", &a, &b).await;

    std::fs::write(first.join("orders.yaml"), webhook_yaml(&b, "")).expect("edit");
    wait_applied(&admin, 1.0).await;
    handled_by(&broker, "edited", &b, &a).await;

    // `ln -sfn second pipelines`, atomically.
    symlink(&second, root.path().join("pipelines.tmp")).expect("symlink");
    std::fs::rename(root.path().join("pipelines.tmp"), &pipelines).expect("rename link over link");
    wait_applied(&admin, 2.0).await;
    handled_by(&broker, "repointed", &c, &b).await;

    std::fs::write(second.join("orders.yaml"), webhook_yaml(&a, "")).expect("edit");
    wait_applied(&admin, 3.0).await;
    handled_by(&broker, "edited again", &a, &c).await;
}
