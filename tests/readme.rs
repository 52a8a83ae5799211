//! The README tells the truth (issue 14): "A complete pipeline" is the shipped
//! `pipelines/orders.yaml` and validates; every sample output it shows is what the binary
//! prints; its example test file passes; its `${VAR}` example (issue 21) says what happens; its
//! first-pipeline walkthrough runs as written; its configuration reference is the schema's; its
//! first command, `scripts/demo`, does what it says; the envelope's required fields are those.

use crate::{support, util};

use std::path::Path;
use std::time::{Duration, Instant};

use util::sluice;

fn readme() -> String {
    std::fs::read_to_string("README.md").expect("README.md")
}

/// The text of the first fenced block opening with "```" + `info` after `marker`.
fn block_after(text: &str, marker: &str, info: &str) -> String {
    let at = text.find(marker).unwrap_or_else(|| panic!("README has no {marker:?}"));
    let mut lines = text[at..].lines();
    while let Some(line) = lines.next() {
        let Some(opened) = line.strip_prefix("```") else { continue };
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        if opened == info {
            return body.iter().map(|l| format!("{l}\n")).collect();
        }
    }
    panic!("no ```{info} block after {marker:?}")
}

/// A directory holding the shipped pipeline (the file, the program it runs, the payload schema
/// it names), laid out as in the repository, without its tests.
fn shipped_pipeline() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for (from, to) in [
        ("pipelines/orders.yaml", "pipelines/orders.yaml"),
        ("pipelines/scripts/audit.sh", "pipelines/scripts/audit.sh"),
        ("schemas/order-created.json", "schemas/order-created.json"),
    ] {
        let to = dir.path().join(to);
        std::fs::create_dir_all(to.parent().expect("a parent")).expect("mkdir");
        std::fs::copy(from, &to).unwrap_or_else(|e| panic!("{from}: {e}"));
    }
    dir
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("UTF-8")
}

#[test]
fn the_complete_pipeline_is_the_shipped_file_and_validates() {
    let shown = block_after(&readme(), "## A complete pipeline", "yaml");
    let shipped = std::fs::read_to_string("pipelines/orders.yaml").expect("pipelines/orders.yaml");
    assert!(shown == shipped, "README's \"A complete pipeline\" differs from pipelines/orders.yaml");
    // Valid with nothing to say, as shown: no warning either.
    let dir = shipped_pipeline();
    let out =
        sluice().args(["validate", "pipelines", "--format", "json"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!((out.status.code(), stdout(&out)), (Some(0), "[]\n".to_string()));
    assert!(Path::new("pipelines/scripts/audit.sh").is_file());
}

// Issue 31: the section shows the two files the pipeline names, as shipped.
#[test]
fn the_complete_pipelines_schema_and_program_are_the_shipped_files() {
    let readme = readme();
    for (info, file) in [("json", "schemas/order-created.json"), ("sh", "pipelines/scripts/audit.sh")] {
        let shown = block_after(&readme, "## A complete pipeline", info);
        let shipped = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(shown == shipped, "README's \"A complete pipeline\" shows another {file}");
    }
}

// Issue 31: the first screen is the user's: the demo before the contents, the contributors'
// commands (`scripts/demo` and `.ci/run`) in "Development".
#[test]
fn the_first_screen_is_the_users() {
    let readme = readme();
    let first = &readme[..readme.find("\n## Contents\n").expect("README has \"## Contents\"")];
    assert!(first.contains("scripts/demo") && !first.contains(".ci/run"), "{first}");
    let development = block_after(&readme, "## Development", "sh");
    assert!(development.contains("scripts/demo") && development.contains(".ci/run"), "{development}");
}

// Issue 31: the envelope the README shows as the smallest is one, and each of its fields is
// required: without any one, the message is malformed.
#[test]
fn the_smallest_envelope_has_exactly_the_required_fields() {
    let shown = block_after(&readme(), "Three fields are required", "json");
    let smallest: serde_json::Value = serde_json::from_str(&shown).expect("JSON");
    let fields = smallest.as_object().expect("an object");
    let mut names: Vec<&String> = fields.keys().collect();
    names.sort();
    assert_eq!(names, ["id", "payload", "type"]);
    assert!(sluice::envelope::Envelope::decode(shown.as_bytes()).is_ok(), "{shown}");
    for field in fields.keys() {
        let mut without = smallest.clone();
        without.as_object_mut().expect("an object").remove(field);
        let body = without.to_string();
        assert!(sluice::envelope::Envelope::decode(body.as_bytes()).is_err(), "accepted without {field}: {body}");
    }
}

#[test]
fn the_validate_sample_is_real_output() {
    let sample = block_after(&readme(), "## `sluice validate` in CI", "");
    let (command, shown) = sample.split_once('\n').expect("a command line, then its output");
    assert_eq!(command, "$ sluice validate pipelines/");
    let dir = shipped_pipeline();
    let file = dir.path().join("pipelines/orders.yaml");
    let text = std::fs::read_to_string(&file).expect("read");
    let anchor = "  max_attempts: 5          # handler runs in all";
    assert!(text.contains(anchor), "the anchor's max_attempts line moved");
    std::fs::write(&file, text.replace(anchor, "  max_attempts: 0          # handler runs in all")).expect("write");
    let out = sluice().args(["validate", "pipelines/"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), shown);
}

#[test]
fn the_test_samples_are_real_output() {
    let readme = readme();
    let section = "## `sluice test`: pipelines tested without a broker";
    let passing = block_after(&readme, section, "");
    let (command, shown) = passing.split_once('\n').expect("a command line, then its output");
    assert_eq!(command, "$ sluice test pipelines");
    let out = sluice().args(["test", "pipelines"]).output().expect("runs");
    assert_eq!((out.status.code(), stdout(&out)), (Some(0), shown.to_string()));

    // The failing sample: the 503 test expecting success.
    let failing = block_after(&readme, "A failing test names each field that differs", "");
    let dir = shipped_pipeline();
    let tests = std::fs::read_to_string("pipelines/orders.test.yaml").expect("read");
    let expectation = "        orders.charge: retry\n";
    assert_eq!(tests.matches(expectation).count(), 1, "the 503 test's expectation moved");
    let tests = tests.replace(expectation, "        orders.charge: success\n");
    std::fs::write(dir.path().join("pipelines/orders.test.yaml"), tests).expect("write");
    let out = sluice().args(["test", "pipelines"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains(&failing), "README's failing sample is not in:\n{}", stdout(&out));
}

#[test]
fn the_test_file_example_passes() {
    let example = block_after(&readme(), "## `sluice test`: pipelines tested without a broker", "yaml");
    let dir = shipped_pipeline();
    std::fs::write(dir.path().join("pipelines/orders.test.yaml"), example).expect("write");
    let out = sluice().args(["test", "pipelines"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stdout(&out).ends_with("test result: ok. 1 passed; 0 failed\n"), "{}", stdout(&out));
}

// Issue 34: the example of message formats validates, and `sluice test` renders each format's
// message as the text says.
#[test]
fn the_formats_example_validates_and_renders() {
    let example = block_after(&readme(), "### Message formats", "yaml");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("p.yaml"), example).expect("write");
    let tests = r#"version: 1
tests:
  - name: a plain JSON order
    message: {exchange: orders, routing_key: order.created, payload: {order_id: 7}}
    expect:
      queues: [orders.created]
      requests: {orders.created: {url: "https://shop.example/hooks/order.created/7"}}
  - name: a CloudEvent from the shop
    message: {exchange: orders, routing_key: event.paid, type: order.paid, source: "https://shop.example/orders", payload: {order_id: 9}}
    expect:
      queues: [orders.events]
      requests: {orders.events: {url: "https://crm.example/events/https%3A%2F%2Fshop.example%2Forders/9"}}
  - name: a CloudEvent from elsewhere
    message: {exchange: orders, routing_key: event.paid, source: "https://other.example/", payload: {order_id: 9}}
    expect: {queues: [], outcomes: {orders.events: filtered}}
"#;
    std::fs::write(dir.path().join("p.test.yaml"), tests).expect("write");
    let out = sluice().arg("validate").arg(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let out = sluice().arg("test").arg(dir.path()).output().expect("runs");
    assert!(stdout(&out).ends_with("test result: ok. 3 passed; 0 failed\n"), "{}", stdout(&out));
}

// Issue 24: the example of binding filters validates against a payload schema that rules out
// other fields, and routes and filters as the text says.
#[test]
fn the_filter_example_validates_and_filters() {
    let example = block_after(&readme(), "### Binding filters", "yaml");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("p.yaml"), example).expect("write");
    let schema = r#"{"type": "object", "additionalProperties": false, "properties": {
        "amount_cents": {"type": "integer"}, "currency": {"type": "string"}, "test": {"type": "boolean"}}}"#;
    std::fs::write(dir.path().join("order.json"), schema).expect("write");
    let tests = r#"version: 1
tests:
  - name: large
    message: {exchange: orders, routing_key: order.created, payload: {amount_cents: 10000, currency: EUR}}
    expect: {queues: [orders.large]}
  - name: small
    message: {exchange: orders, routing_key: order.created, payload: {amount_cents: 9999, currency: EUR}}
    expect: {queues: [], outcomes: {orders.large: filtered}}
  - name: a test
    message: {exchange: orders, routing_key: order.created, payload: {amount_cents: 10000, currency: USD, test: true}}
    expect: {queues: [], outcomes: {orders.large: filtered}}
  - name: a refund
    message: {exchange: orders, routing_key: refund.partial, payload: {amount_cents: 1}}
    expect: {queues: [orders.large]}
"#;
    std::fs::write(dir.path().join("p.test.yaml"), tests).expect("write");
    let out = sluice().arg("validate").arg(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let out = sluice().arg("test").arg(dir.path()).output().expect("runs");
    assert!(stdout(&out).ends_with("test result: ok. 4 passed; 0 failed\n"), "{}", stdout(&out));
}

// Issue 34: the per-key ordering example validates; its key naming a field its format does not
// have (`subject` is a CloudEvent's) is an error at `order_by`.
#[test]
fn the_order_by_example_validates_and_its_key_is_checked() {
    let example = block_after(&readme(), "## Per-key ordering", "yaml");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("p.yaml"), &example).expect("write");
    let out = sluice().arg("validate").arg(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let wrong = example.replace("{{payload.customer_id}}", "{{subject}}");
    assert_ne!(wrong, example, "the example orders by {{{{payload.customer_id}}}}");
    std::fs::write(dir.path().join("p.yaml"), wrong).expect("write");
    let out = sluice().arg("validate").arg(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let said = format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("/queues/orders.sync/order_by"), "{said}");
}

// Issue 21: the example of `${VAR}` in a pipeline file, what `validate` says without the
// variables, and the call `render` shows with them.
#[test]
fn the_environment_example_is_real_output() {
    let readme = readme();
    let example = block_after(&readme, "## Environment variables in pipeline files", "yaml");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("pipelines")).expect("mkdir");
    std::fs::write(dir.path().join("pipelines/charge.yaml"), example).expect("write");
    let command = |line: &str| {
        let words: Vec<&str> = line.strip_prefix("$ ").expect("a command line").split(' ').collect();
        let (env, rest) = words.split_at(words.iter().position(|w| *w == "sluice").expect("runs sluice"));
        let mut cmd = sluice();
        cmd.args(&rest[1..]).current_dir(dir.path());
        for name in ["PAYMENTS_URL", "PAYMENTS_TOKEN", "CHARGE_WORKERS", "RUNNER_NAME"] {
            cmd.env_remove(name);
        }
        for assignment in env {
            let (name, value) = assignment.split_once('=').expect("NAME=value");
            cmd.env(name, value);
        }
        cmd
    };

    let sample = block_after(&readme, "`sluice validate` only warns of an unset variable", "");
    let (line, shown) = sample.split_once('\n').expect("a command line, then its output");
    assert_eq!(line, "$ sluice validate pipelines/");
    let out = command(line).output().expect("runs");
    assert_eq!((out.status.code(), stdout(&out)), (Some(0), shown.to_string()));
    let out = command(&format!("{line} --env-strict")).output().expect("runs");
    assert_eq!(out.status.code(), Some(1));

    let sample = block_after(&readme, "With them set, the call a message makes", "");
    let (line, shown) = sample.split_once('\n').expect("a command line, then its output");
    // The body is the envelope as sent: the message file.
    let envelope = shown.lines().last().expect("a body");
    std::fs::write(dir.path().join("order.json"), envelope).expect("write");
    let out = command(line).output().expect("runs");
    assert_eq!((out.status.code(), stdout(&out)), (Some(0), shown.to_string()));
}

const REFERENCE_START: &str = "<!-- The table below is generated from schemas/pipeline.schema.json";
const REFERENCE_END: &str = "<!-- end of the generated table -->";

/// Issue 24: the outbound auth example is a valid pipeline; only its secret and certificate
/// files, absent here as in CI, are warned about.
#[test]
fn the_outbound_auth_example_validates() {
    let shown = block_after(&readme(), "## Outbound auth", "yaml");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("p.yaml"), shown).expect("write");
    let out = sluice().args(["validate", "--format", "json"]).arg(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let diagnostics: Vec<serde_json::Value> = serde_json::from_str(&stdout(&out)).expect("JSON");
    let pointers: Vec<&str> = diagnostics.iter().filter_map(|d| d["pointer"].as_str()).collect();
    let base = "/queues/orders.sync/handler/webhook";
    assert_eq!(
        pointers,
        [
            format!("{base}/auth/oauth2/client_secret_file"),
            format!("{base}/tls/client_cert_file"),
            format!("{base}/tls/client_key_file"),
            format!("{base}/tls/ca_file"),
        ],
        "{diagnostics:?}"
    );
    assert!(diagnostics.iter().all(|d| d["severity"] == "warning"), "{diagnostics:?}");
}

// Issue 21: the README's configuration reference is the schema's keys, descriptions and
// defaults, as `sluice schema --reference` prints them. UPDATE_README=1 rewrites the table.
#[test]
fn the_configuration_reference_is_the_schemas() {
    let out = sluice().args(["schema", "--reference"]).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    // A blank line ends the table before the end marker.
    let generated = stdout(&out) + "\n";
    let readme = readme();
    let start = readme.find(REFERENCE_START).expect("README has the generated table's start marker");
    let table = start + readme[start..].find('\n').expect("a line after the marker") + 1;
    let end = table + readme[table..].find(REFERENCE_END).expect("README has the generated table's end marker");
    let shown = &readme[table..end];
    if shown == generated {
        return;
    }
    if std::env::var_os("UPDATE_README").is_some() {
        let updated = format!("{}{generated}{}", &readme[..table], &readme[end..]);
        std::fs::write("README.md", updated).expect("write README.md");
        return;
    }
    let diff: Vec<String> = shown
        .lines()
        .filter(|l| !generated.lines().any(|g| g == *l))
        .map(|l| format!("- {l}"))
        .chain(generated.lines().filter(|g| !shown.lines().any(|l| l == *g)).map(|g| format!("+ {g}")))
        .collect();
    panic!(
        "README's configuration reference differs from schemas/pipeline.schema.json (- README only, + schema only; none: the order):\n{}\n\
         regenerate it with: UPDATE_README=1 cargo test --test suite readme::the_configuration_reference",
        diff.join("\n")
    );
}

/// A walkthrough's output with what differs from run to run (message ids, times, ages) and the
/// width of table columns made alike.
fn normalized(text: &str) -> String {
    let token = |t: &str| -> String {
        let bytes = t.as_bytes();
        let id = t.len() == 36
            && bytes
                .iter()
                .enumerate()
                .all(|(i, b)| if [8, 13, 18, 23].contains(&i) { *b == b'-' } else { b.is_ascii_hexdigit() });
        let time = t.len() == 20 && t.ends_with('Z') && t.as_bytes()[10] == b'T';
        let age = t.trim_end_matches(['s', 'm', 'h']).parse::<u64>().is_ok() && t.ends_with(['s', 'm', 'h']);
        match (id, time, age) {
            (true, _, _) => "<id>".into(),
            (_, true, _) => "<time>".into(),
            (_, _, true) => "<age>".into(),
            _ => t.to_string(),
        }
    };
    text.lines().map(|l| l.split_whitespace().map(token).collect::<Vec<_>>().join(" ") + "\n").collect()
}

/// The `sluice run` the walkthrough starts in a second terminal; stopped on drop.
struct Runner(std::process::Child);

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// Issue 21: "Your first pipeline" runs as written, in one directory on the embedded broker: its
// files are written where their first comment says, its commands run in order (`sluice run` in
// the background), and each prints what the README shows. A command that only looks (`cat`,
// `status`, `dlq list`) is run again until it does, as the runner works meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_pipeline_walkthrough_runs_as_written() {
    let readme = readme();
    let start = readme.find("## Your first pipeline").expect("README has \"Your first pipeline\"");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |end| end + 3)];
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = tempfile::tempdir().expect("tempdir");
    // A port of its own: tests run side by side.
    let admin = format!("127.0.0.1:{}", support::free_port());
    let bin = Path::new(env!("CARGO_BIN_EXE_sluice")).parent().expect("the binary's directory");
    let path = std::env::join_paths(
        std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .expect("PATH");
    let shell = |line: &str| {
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", &line.replace("127.0.0.1:9464", &admin)])
            .current_dir(dir.path())
            .env("PATH", &path)
            .env("SLUICE_ADMIN", &admin)
            .env_remove("SLUICE_BROKER")
            .env_remove("SLUICE_DEDUP")
            .env_remove("SLUICE_ADMIN_TOKEN");
        cmd
    };
    let mut runner = None;
    let mut commands = 0;
    let mut lines = section.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.strip_prefix("```") else { continue };
        let block: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        if info == "yaml" || info == "sh" {
            let named = block.iter().take(2).find_map(|l| l.strip_prefix("# pipelines/"));
            let name = named.and_then(|n| n.split([' ', ':']).next()).expect("a file block names its file");
            let file = dir.path().join("pipelines").join(name);
            std::fs::create_dir_all(file.parent().expect("a parent")).expect("mkdir");
            std::fs::write(&file, block.iter().map(|l| format!("{l}\n")).collect::<String>()).expect("write");
            continue;
        }
        assert_eq!(info, "", "the walkthrough's blocks are files (yaml, sh) or commands");
        let mut i = 0;
        while i < block.len() {
            let command = block[i].strip_prefix("$ ").expect("a command line");
            let shown: String =
                block[i + 1..].iter().take_while(|l| !l.starts_with("$ ")).map(|l| format!("{l}\n")).collect();
            i += 1 + shown.lines().count();
            commands += 1;
            if command.starts_with("sluice run") {
                assert!(shown.is_empty(), "the runner's log is not shown");
                let log = std::fs::File::create(logs.path().join("run.log")).expect("log file");
                let child = shell(&format!("exec {command}")).stderr(log).spawn().expect("spawn sluice run");
                runner = Some(Runner(child));
                support::wait_until(Duration::from_secs(30), "the runner ready", || async {
                    let ready = support::http().get(format!("http://{admin}/readyz")).send().await;
                    ready.is_ok_and(|r| r.status().is_success())
                })
                .await;
                continue;
            }
            let looks = ["cat ", "sluice status", "sluice dlq list"].iter().any(|p| command.starts_with(p));
            let deadline = Instant::now() + Duration::from_secs(if looks { 30 } else { 0 });
            loop {
                let out = shell(command).output().expect("runs");
                let printed = stdout(&out) + &String::from_utf8_lossy(&out.stderr);
                if out.status.success() && normalized(&printed) == normalized(&shown) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "`{command}` printed (exit {:?}):\n{printed}\nthe README shows:\n{shown}\nthe runner's log:\n{}",
                    out.status.code(),
                    std::fs::read_to_string(logs.path().join("run.log")).unwrap_or_default()
                );
                // Not a fixed wait before an assertion: the command runs again until it prints
                // what the README shows.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert!(commands >= 15, "the walkthrough's commands were found: {commands}");
    let Runner(child) = runner.as_mut().expect("the walkthrough starts the runner");
    // SAFETY: kill(2) with the pid of a child we own; Ctrl-C, as the README says.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the runner did not stop on Ctrl-C");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(0), "the runner exits 0 on Ctrl-C");
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes.
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

// Issue 21: the README's table of contents names every section, and only sections there are.
#[test]
fn the_contents_list_every_section() {
    let readme = readme();
    let mut headings = Vec::new();
    let mut fenced = false;
    for line in readme.lines() {
        fenced ^= line.starts_with("```");
        let heading = line.strip_prefix("## ").or_else(|| line.strip_prefix("### "));
        if let Some(heading) = heading.filter(|h| !fenced && *h != "Contents") {
            headings.push(format!("#{}", anchor(heading)));
        }
    }
    let start = readme.find("## Contents\n").expect("README has \"## Contents\"");
    let contents = &readme[start..start + readme[start..].find("\n## Install").expect("Install follows the contents")];
    let listed: Vec<String> = contents
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- ["))
        .filter_map(|l| Some(l.split_once("](")?.1.strip_suffix(')')?.to_string()))
        .collect();
    assert_eq!(listed, headings, "README's contents (left) and its sections (right), in order");
}

/// The README's first command: `scripts/demo` (with this build's binary, as `SLUICE_BIN` lets
/// it) runs the shipped pipeline on the embedded broker, prints the receiver's calls, the audit
/// log, `sluice status` and the order whose payload failed its schema in `orders.charge.dlq`.
#[test]
fn the_demo_runs_as_the_readme_says() {
    let out = std::process::Command::new("bash")
        .arg("scripts/demo")
        .env("SLUICE_BIN", env!("CARGO_BIN_EXE_sluice"))
        .env_remove("SLUICE_BROKER")
        .output()
        .expect("run scripts/demo");
    let printed = format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "scripts/demo failed:\n{printed}");
    for expected in [
        "/charge/1001",
        "/charge/1002",
        "order=1001 attempt=1 key=order:1001",
        "order=1002 attempt=1 key=order:1002",
        "demo done",
    ] {
        assert!(printed.contains(expected), "scripts/demo printed no {expected:?}:\n{printed}");
    }
    let dead = printed.lines().any(|l| l.contains("order.created  schema") && l.contains("order:1003"));
    assert!(dead, "`dlq list orders.charge` shows no order:1003 dead-lettered for its schema:\n{printed}");
    assert!(!printed.contains("/charge/not-a-number"), "the bad order reached the receiver:\n{printed}");
}
