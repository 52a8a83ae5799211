//! Bytes as a pipeline file, through the loader `sluice validate` uses (discovery, YAML,
//! `${VAR}`, schema, merge, semantic checks, templates) and its diagnostics in every format;
//! a config that loads is then planned, as `sluice run` and `sluice plan` do. Refusing is
//! fine; panicking, hanging or taking unbounded memory is the bug.
#![no_main]

use std::path::PathBuf;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use sluice::config::{self, Format, Unset};

/// A directory of this process's own, holding the one file; scripts/fuzz.sh points TMPDIR at a
/// directory it removes afterwards.
static DIR: LazyLock<PathBuf> = LazyLock::new(|| {
    let dir = std::env::temp_dir().join(format!("sluice-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the pipeline file");
    dir
});

fuzz_target!(|data: &[u8]| {
    std::fs::write(DIR.join("pipeline.yaml"), data).expect("write the pipeline file");
    let validation = config::load_with(std::slice::from_ref(&*DIR), Unset::Warning).on_nodes(3);
    for format in [Format::Human, Format::Json, Format::Github] {
        let _ = validation.render(format);
    }
    if let Some(config) = &validation.config {
        let _ = sluice::topology::plan(config);
    }
});
