//! `${VAR}` in pipeline files (issue 21, point 6): resolved when the files are loaded, with
//! file:line:column for an unset variable; `validate` warns of one (CI has no secrets) and
//! `validate --env-strict` refuses it, as `run` and `test` do; the values are what runs.

use crate::support;
use crate::util;

use std::time::Duration;

use serde_json::json;
use sluice::broker::Broker as _;
use support::*;

/// A webhook queue whose URL's scheme and host come from `SLUICE_T21_HOOK`, on line 6, the
/// `${` at column 15.
const HOOK_FROM_ENV: &str = "version: 1
queues:
  work:
    handler:
      webhook:
        url: \"${SLUICE_T21_HOOK}/hook\"
";

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn validate_warns_of_an_unset_variable_and_env_strict_refuses_it() {
    let dir = pipeline(HOOK_FROM_ENV);
    let file = dir.path().join("pipeline.yaml");
    let at = format!("{}:6:15", file.display());
    let validate = |extra: &[&str]| {
        util::sluice()
            .arg("validate")
            .arg(dir.path())
            .args(extra)
            .env_remove("SLUICE_T21_HOOK")
            .output()
            .expect("sluice runs")
    };

    let out = validate(&[]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let want = format!(
        "{at}: warning: /queues/work/handler/webhook/url: environment variable SLUICE_T21_HOOK is not set here, \
         and `${{SLUICE_T21_HOOK}}` has no default: `sluice run` refuses this file where it is unset\n"
    );
    assert!(stdout(&out).starts_with(&want), "{}", stdout(&out));
    // The queue is there, its URL unchecked: nothing else is said about it.
    assert_eq!(stdout(&out).matches(": warning: ").count(), 1, "{}", stdout(&out));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "ok: 1 queue(s) valid\n");

    let out = validate(&["--env-strict"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let want = format!(
        "{at}: error: /queues/work/handler/webhook/url: environment variable SLUICE_T21_HOOK is not set, \
         and `${{SLUICE_T21_HOOK}}` has no default: set it, or give one, as in `${{SLUICE_T21_HOOK:-default}}`\n"
    );
    assert!(stdout(&out).starts_with(&want), "{}", stdout(&out));
    assert_eq!(stdout(&out).matches(": error: ").count(), 1, "{}", stdout(&out));

    // Set, the variable is what validate checks: an ftp URL is refused.
    let out = util::sluice()
        .arg("validate")
        .arg(dir.path())
        .env("SLUICE_T21_HOOK", "ftp://h.example")
        .output()
        .expect("sluice runs");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(stdout(&out).contains("webhook URLs are http or https"), "{}", stdout(&out));
}

#[test]
fn run_refuses_a_file_with_an_unset_variable_at_its_place() {
    let dir = pipeline(HOOK_FROM_ENV);
    let broker = EmbeddedDir::new();
    let mut sluice = Sluice::run(dir.path(), &broker.url(), &[]);
    assert_eq!(sluice.wait(Duration::from_secs(20)), Some(1), "{}", sluice.log());
    let at = format!("{}:6:15: error: ", dir.path().join("pipeline.yaml").display());
    assert!(sluice.log().contains(&at), "{}", sluice.log());
}

// The URL's scheme and host come from the environment, a header's value from a default, with
// `$$` for a literal dollar, and `concurrency` is a number from a plain scalar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_calls_the_url_the_environment_gives() {
    let place = EmbeddedDir::new();
    let receiver = Receiver::ok().await;
    let dir = work_pipeline(concat!(
        "    concurrency: ${SLUICE_T21_CONCURRENCY:-2}\n",
        "    handler:\n",
        "      webhook:\n",
        "        url: \"${SLUICE_T21_HOOK}/hook/{{payload.n}}\"\n",
        "        headers: {X-Env: \"${SLUICE_T21_UNSET:-fallback} costs $$5, not $${SLUICE_T21_HOOK}\"}\n",
    ));
    let mut sluice = Sluice::run_with_env(dir.path(), &place.url(), &[], &[("SLUICE_T21_HOOK", receiver.uri())]);
    wait_until(Duration::from_secs(30), "the runner consuming", || async {
        let broker = place.connect().await;
        broker.stats("work").await.map(|s| s.consumers == 1).unwrap_or(false)
    })
    .await;
    let broker = place.connect().await;
    publish(&broker, "ev", "k", "key-1", json!({"n": 7})).await;
    let hits = receiver.wait_for(1, Duration::from_secs(20)).await;
    assert_eq!(hits[0].target, "/hook/7");
    assert_eq!(hits[0].header("x-env"), Some("fallback costs $5, not ${SLUICE_T21_HOOK}"));
    assert_eq!(sluice.stop(Duration::from_secs(20)), Some(0), "{}", sluice.log());
    assert_eq!(place.depth("work.dlq").await, 0);
}

#[test]
fn sluice_test_renders_the_value_the_environment_gives() {
    let dir = work_pipeline(
        "    handler:\n      command: {program: /bin/echo, args: [\"${SLUICE_T21_ARG}\", \"{{payload.n}}\"]}\n",
    );
    let tests = "version: 1
tests:
  - name: the first argument comes from the environment
    message: {exchange: ev, routing_key: k, payload: {n: 7}}
    expect:
      requests:
        work:
          argv: [/bin/echo, from-env, \"7\"]
";
    std::fs::write(dir.path().join("work.test.yaml"), tests).expect("write tests");
    let test = |env: &[(&str, &str)]| {
        util::sluice()
            .arg("test")
            .arg(dir.path())
            .env_remove("SLUICE_T21_ARG")
            .envs(env.iter().copied())
            .output()
            .expect("sluice runs")
    };
    let out = test(&[("SLUICE_T21_ARG", "from-env")]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stdout(&out).ends_with("test result: ok. 1 passed; 0 failed\n"), "{}", stdout(&out));

    let out = test(&[("SLUICE_T21_ARG", "elsewhere")]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));

    let out = test(&[]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    // `args: ["${` on line 8: the `$` at column 45.
    let at =
        format!("{}:8:45: error: /queues/work/handler/command/args/0: ", dir.path().join("pipeline.yaml").display());
    assert!(stdout(&out).contains(&at), "{}", stdout(&out));
}

/// The `error:` lines `sluice validate DIR` prints with `env` set, each without its file name.
fn validate_errors(dir: &std::path::Path, env: &[(&str, &str)]) -> Vec<String> {
    let out = util::sluice().arg("validate").arg(dir).envs(env.iter().copied()).output().expect("sluice runs");
    let prefix = format!("{}:", dir.join("pipeline.yaml").display());
    stdout(&out).lines().filter(|l| l.contains(": error: ")).map(|l| l.replacen(&prefix, "", 1)).collect()
}

// Issue 31: `${Y}` set to `~` or `null` said "`${Y is not a finite number`". YAML reads the
// substituted text as it would the same text in the file: `~` is null, which is not a number,
// and the message says where the null came from; `1e400` is refused as past a float.
#[test]
fn a_variable_set_to_null_or_past_a_float_is_named_in_the_message() {
    let dir = pipeline(concat!(
        "version: 1\n",
        "exchanges:\n",
        "  ev: {type: topic}\n",
        "queues:\n",
        "  work:\n",
        "    max_length: ${SLUICE_T31_Y}\n",
        "    bind:\n",
        "      - exchange: ev\n",
        "        filter:\n",
        "          field: payload.amount\n",
        "          gte: ${SLUICE_T31_Y}\n",
        "    handler: {command: {program: /bin/true}}\n",
    ));
    for value in ["~", "null"] {
        let because = format!("(${{SLUICE_T31_Y}} is \"{value}\" here, which YAML reads as null)");
        assert_eq!(
            validate_errors(dir.path(), &[("SLUICE_T31_Y", value)]),
            [
                format!("6:17: error: /queues/work/max_length: null is not of type \"integer\" {because}"),
                format!("11:16: error: /queues/work/bind/0/filter/gte: null is not of type \"number\" {because}"),
            ],
            "{value}"
        );
    }
    let past = "1e400 (${SLUICE_T31_Y} here) is not a finite number (at most about 1.8e308 either way)";
    assert_eq!(
        validate_errors(dir.path(), &[("SLUICE_T31_Y", "1e400")]),
        [
            format!("6:17: error: /queues/work/max_length: {past}"),
            format!("11:16: error: /queues/work/bind/0/filter/gte: {past}"),
        ]
    );
    assert_eq!(validate_errors(dir.path(), &[("SLUICE_T31_Y", "100")]), Vec::<String>::new());
}

// Issue 31: the error for the environment adding more than a MiB to a file named whichever
// variable came next, and every one after it, however small. It names the variable that fills
// the file; a small one after the limit still fits and is substituted.
#[test]
fn the_mib_the_environment_may_add_is_blamed_on_the_variable_that_fills_it() {
    let big = "b".repeat(70 << 10);
    let medium = "m".repeat(50 << 10);
    let env = [("SLUICE_T31_BIG", big.as_str()), ("SLUICE_T31_MEDIUM", medium.as_str()), ("SLUICE_T31_SMALL", "s")];
    let args = |list: &[&str]| {
        let quoted: Vec<String> = list.iter().map(|name| format!("\"${{{name}}}\"")).collect();
        format!("    handler:\n      command:\n        program: /bin/true\n        args: [{}]\n", quoted.join(", "))
    };
    // The strings are substituted from the last to the first: 14 BIGs (1,003,520 bytes) fit,
    // then MEDIUM would pass the limit.
    let mut list = vec!["SLUICE_T31_MEDIUM"];
    list.extend(["SLUICE_T31_BIG"; 14]);
    let dir = work_pipeline(&args(&list));
    assert_eq!(
        validate_errors(dir.path(), &env),
        ["10:17: error: /queues/work/handler/command/args/0: substituting SLUICE_T31_MEDIUM here makes the \
          environment's values add more than 1024 KiB to this file, the most allowed: most of them come from \
          SLUICE_T31_BIG (1003520 bytes in 14 uses)"]
    );
    // The 15th BIG passes the limit; SMALL, substituted after it, still fits.
    let mut list = vec!["SLUICE_T31_SMALL"];
    list.extend(["SLUICE_T31_BIG"; 15]);
    let dir = work_pipeline(&args(&list));
    assert_eq!(
        validate_errors(dir.path(), &env),
        ["10:40: error: /queues/work/handler/command/args/1: substituting SLUICE_T31_BIG here makes the \
          environment's values add more than 1024 KiB to this file, the most allowed: SLUICE_T31_BIG would add \
          1075200 bytes in 15 uses"]
    );
}
