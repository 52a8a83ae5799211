#!/usr/bin/env bash
# Fuzzing (issue 19): runs each cargo-fuzz target in fuzz/ for SECONDS (default 600), one at a
# time under `nice`, then prints a summary: runs, execs/s, coverage, corpus, peak memory and
# whether it crashed. The targets and the latest figures are in BENCHMARKS.md ("Fuzzing").
#
#   scripts/fuzz.sh [SECONDS]
#   TARGETS="topic_match envelope_decode" scripts/fuzz.sh 60
#   MERGE=1 scripts/fuzz.sh          # then adds what found new coverage to fuzz/corpus/
#
# Each target starts from its committed corpus in fuzz/corpus/TARGET (read only); what it finds
# goes to a scratch directory, removed at the end unless MERGE=1 merges the inputs that add
# coverage into fuzz/corpus/TARGET (libFuzzer's -merge=1, so the corpus stays minimal). An input
# that crashes, takes more than TIMEOUT seconds or more than RSS_MB of memory is saved in
# fuzz/artifacts/TARGET/ (replay it with `cargo +nightly fuzz run TARGET FILE`); each such input
# becomes a regression test in the normal test suite before it is fixed.
#
# Knobs (environment): TARGETS (all four), TIMEOUT=10 (seconds per input), RSS_MB=2048. One
# process at a time. Built with debug assertions (integer overflow is a crash) and without a
# sanitizer: the code under test is safe Rust, and ASan would halve the
# executions per second. Needs the nightly toolchain and cargo-fuzz
# (`rustup toolchain install nightly && cargo install cargo-fuzz`).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-600}
targets=${TARGETS:-pipeline_loader envelope_decode template_render topic_match}
timeout=${TIMEOUT:-10} rss_mb=${RSS_MB:-2048}

if [ $# -gt 1 ] || ! [[ $seconds =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 [SECONDS]   (each target runs SECONDS, default 600)" >&2
  exit 2
fi
if ! cargo +nightly --version > /dev/null 2>&1; then
  echo "$0: needs the nightly toolchain: rustup toolchain install nightly" >&2
  exit 1
fi
if ! cargo +nightly fuzz --version > /dev/null 2>&1; then
  echo "$0: needs cargo-fuzz: cargo install cargo-fuzz" >&2
  exit 1
fi

flags=(--sanitizer none --debug-assertions)
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
  flags+=(--target-dir "$CARGO_TARGET_DIR/fuzz")
fi

# Scratch: the corpus each run grows, the logs, and TMPDIR (the pipeline loader's files).
scratch=$(mktemp -d "${TMPDIR:-/tmp}/sluice-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

cd "$repo"
echo "building the fuzz targets (cargo +nightly fuzz build)" >&2
nice -n 10 cargo +nightly fuzz build "${flags[@]}" >&2

# A final statistic of libFuzzer's (-print_final_stats=1) from the log $log.
stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -1; }

failed=0
rows=()
for target in $targets; do
  mkdir -p "$scratch/$target" "$scratch/tmp" "fuzz/corpus/$target"
  log="$scratch/$target.log"
  echo "fuzzing $target for ${seconds}s" >&2
  status=0
  TMPDIR="$scratch/tmp" nice -n 10 cargo +nightly fuzz run "${flags[@]}" "$target" \
    "$scratch/$target" "fuzz/corpus/$target" -- \
    -max_total_time="$seconds" -timeout="$timeout" -rss_limit_mb="$rss_mb" -print_final_stats=1 \
    > "$log" 2>&1 || status=$?
  runs=$(stat number_of_executed_units) rate=$(stat average_exec_per_sec) peak=$(stat peak_rss_mb)
  # The last status line: "#N <event> cov: C ft: F corp: U/SIZE ...".
  last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
  cov=$(sed -n 's/.*cov: \([0-9]*\).*/\1/p' <<< "$last")
  ft=$(sed -n 's/.*ft: \([0-9]*\).*/\1/p' <<< "$last")
  corp=$(sed -n 's/.*corp: \([0-9]*\/[0-9A-Za-z]*\).*/\1/p' <<< "$last")
  if [ "$status" -eq 0 ]; then
    result="ok"
  else
    failed=1
    artifact=$(sed -n 's/.*Test unit written to \(.*\)/\1/p' "$log" | tail -1)
    result="FAILED (exit $status${artifact:+, input $artifact})"
    mkdir -p "fuzz/artifacts/$target"
    cp "$log" "fuzz/artifacts/$target/last-run.log"
    echo "$target failed: the log is fuzz/artifacts/$target/last-run.log" >&2
    tail -30 "$log" >&2
  fi
  if [ "${MERGE:-0}" = 1 ] && [ "$status" -eq 0 ]; then
    echo "merging new coverage of $target into fuzz/corpus/$target" >&2
    TMPDIR="$scratch/tmp" nice -n 10 cargo +nightly fuzz run "${flags[@]}" "$target" \
      "fuzz/corpus/$target" "$scratch/$target" -- -merge=1 -timeout="$timeout" \
      > "$scratch/$target.merge.log" 2>&1
  fi
  rows+=("$(printf '%-16s %7ss %12s %9s %7s %7s %12s %8s  %s' "$target" "$seconds" "${runs:-?}" \
    "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "${peak:-?}MB" "$result")")
done

printf '\n%-16s %8s %12s %9s %7s %7s %12s %8s  %s\n' target time runs execs/s cov ft corpus peak result
printf '%s\n' "${rows[@]}"
exit "$failed"
