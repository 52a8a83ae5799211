#!/usr/bin/env bash
# Peak RSS of sluice with large messages on the embedded broker (issue 19.7): `publish` of one
# message larger than every queue's max_message_bytes (refused), `publish --jsonl` of many
# small lines (streamed), and `run` handed one message over its queue's limit (dead-lettered
# as too_large). The method and the latest figures are in BENCHMARKS.md ("Large messages:
# memory").
#
#   scripts/bench-embedded-memory.sh SLUICE_BINARY [MORE_BINARIES...]
#
# Each binary gets a broker directory of its own and the same inputs: a topic exchange `ev`,
# queue `work` (default max_message_bytes, 16 MiB) bound with `k`, a command handler
# (/bin/true). Each figure is /usr/bin/time -v's "Maximum resident set size" of one process.
# - publish: a payload file of BIG_BYTES (default 300 MB) of one JSON string.
# - jsonl: LINES (default 1,000,000) lines of {"n": I}.
# - run: one message of RUN_BYTES (default 100 MB) published while the queue's limit is
#   512 MiB (a runner's declare with that pipeline), then `run --exit-when-idle` with the
#   default 16 MiB, which dead-letters it as too_large.
# Needs python3 and /usr/bin/time (Debian/Ubuntu package `time`).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 SLUICE_BINARY [MORE_BINARIES...]" >&2; exit 2; }
big=${BIG_BYTES:-300000000} lines=${LINES:-1000000} run_bytes=${RUN_BYTES:-100000000}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 - "$tmp" "$big" "$lines" "$run_bytes" <<'PY'
import sys
tmp, big, lines, run_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for name, size in (("big.json", big), ("run.json", run_bytes)):
    with open(f"{tmp}/{name}", "w") as f:
        f.write('{"blob": "'); f.write("x" * size); f.write('"}\n')
with open(f"{tmp}/lines.jsonl", "w") as f:
    f.writelines(f'{{"n": {i}}}\n' for i in range(lines))
PY
pipeline() {
  mkdir -p "$1"
  printf 'version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n  work:\n%s    bind: [{exchange: ev, routing_key: k}]\n    handler: {command: {program: /bin/true}}\n' "$2" >"$1/p.yaml"
}
# Peak RSS in MiB of a command; its exit status is not the point (a refusal is expected).
peak() {
  /usr/bin/time -v -o "$tmp/time.txt" "$@" >/dev/null 2>"$tmp/err.txt" || true
  awk -F': ' '/Maximum resident set size/ { printf "%.0f", $2 / 1024 }' "$tmp/time.txt"
}
echo "| binary | publish ${big} B (MiB) | jsonl ${lines} lines (MiB) | run, one ${run_bytes} B message (MiB) |"
echo "| --- | ---: | ---: | ---: |"
for bin in "$@"; do
  bin=$(realpath "$bin") b="$tmp/$(basename "$bin")-$RANDOM"
  pipeline "$b/default" "" && pipeline "$b/large" $'    max_message_bytes: 512MiB\n'
  # A broker of its own for each figure, declared by a runner on the empty queue.
  for kind in publish jsonl run; do
    "$bin" run "$b/default" --broker "$b/$kind" --exit-when-idle --dedup "$b/dedup" 2>/dev/null
  done
  pub=(publish --exchange ev --routing-key k --type t)
  p1=$(peak "$bin" "${pub[@]}" --broker "$b/publish" --payload-file "$tmp/big.json")
  p2=$(peak "$bin" "${pub[@]}" --broker "$b/jsonl" --jsonl "$tmp/lines.jsonl")
  "$bin" run "$b/large" --broker "$b/run" --exit-when-idle --dedup "$b/dedup" 2>/dev/null
  "$bin" "${pub[@]}" --broker "$b/run" --payload-file "$tmp/run.json" 2>/dev/null
  p3=$(peak "$bin" run "$b/default" --broker "$b/run" --exit-when-idle --dedup "$b/dedup")
  dead=$("$bin" dlq list work --pipelines "$b/default" --broker "$b/run" --format json 2>/dev/null | grep -o '"too_large"' | wc -l)
  echo "| $("$bin" --version) | $p1 | $p2 | $p3 (too_large in the DLQ: $dead) |"
done
