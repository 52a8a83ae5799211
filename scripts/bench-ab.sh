#!/usr/bin/env bash
# The happy path of two sluice builds side by side (issue 24's "no regression" check): for each
# run, a fresh embedded broker, one webhook queue (concurrency 50, idempotency on) to
# `sluice demo-receiver`, MESSAGES published with `publish --jsonl`, then `run --exit-when-idle`
# timed as a whole process. The builds alternate; the ratios of the medians come last. With
# --rabbitmq, the queue is a quorum queue on RabbitMQ at 127.0.0.1:5672 (a fresh vhost per
# run), the idempotency keys in the run's state directory.
#
#   scripts/bench-ab.sh [--rabbitmq] OLD_SLUICE NEW_SLUICE [MESSAGES] [RUNS]   # defaults: 30000 5
set -euo pipefail
cd "$(dirname "$0")/.."
rabbitmq=0
if [[ ${1:-} == --rabbitmq ]]; then rabbitmq=1; shift; fi
old=$(realpath "$1") new=$(realpath "$2")
messages=${3:-30000}
runs=${4:-5}
source scripts/bench-lib.sh

happy_path "$new" "$messages"

# run_once BINARY: prints messages/s, CPU seconds (user + system) and peak RSS (MiB) of one drain.
run_once() {
  local dir broker=()
  dir=$(mktemp -d "$tmp/run.XXXX")
  if [[ $rabbitmq == 1 ]]; then
    make_vhost "sluice-bench-ab-$$-${dir##*.}"
    broker=(--broker "$url")
  fi
  (cd "$dir" && "$1" run "$tmp/p" "${broker[@]}" --exit-when-idle 2>/dev/null &&
    "$1" publish "${broker[@]}" --exchange bench --routing-key work --type t --jsonl "$tmp/m.jsonl" >/dev/null 2>&1)
  local start end
  start=$(date +%s.%N)
  (cd "$dir" && /usr/bin/time -f "%U %S %M" -o "$dir/time" "$1" run "$tmp/p" "${broker[@]}" --exit-when-idle 2>/dev/null)
  end=$(date +%s.%N)
  if [[ $rabbitmq == 1 ]]; then drop_vhost; fi
  python3 -c "u, s, m = open('$dir/time').read().split(); print(round($messages / ($end - $start)), round(float(u) + float(s), 2), round(int(m) / 1024))"
  rm -rf "$dir"
}

results=()
for i in $(seq "$runs"); do
  for build in old new; do
    binary=$old; [[ $build == new ]] && binary=$new
    read -r rate cpu rss < <(run_once "$binary")
    printf '%s run %d: %6d messages/s, %5.2f CPU s, %4d MiB peak RSS\n' "$build" "$i" "$rate" "$cpu" "$rss"
    results+=("$build $rate $cpu $rss")
  done
done
kill "$receiver"
printf '%s\n' "${results[@]}" | python3 -c "
import sys, statistics as st
rows = [l.split() for l in sys.stdin]
med = lambda b, i: st.median(float(r[i]) for r in rows if r[0] == b)
print(f'median: old {med(\"old\", 1):.0f} msg/s, {med(\"old\", 2):.2f} CPU s, {med(\"old\", 3):.0f} MiB; new {med(\"new\", 1):.0f} msg/s, {med(\"new\", 2):.2f} CPU s, {med(\"new\", 3):.0f} MiB')
print(f'throughput new / old {med(\"new\", 1) / med(\"old\", 1):.3f}; CPU per message new / old {med(\"new\", 2) / med(\"old\", 2):.3f}; peak RSS new / old {med(\"new\", 3) / med(\"old\", 3):.3f}')"
