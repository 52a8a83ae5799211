#!/usr/bin/env bash
# Where the happy path's time goes (issue 33 point 1): the pipeline of scripts/bench-ab.sh (one
# webhook queue, concurrency 50, idempotency on, to `sluice demo-receiver`), MESSAGES published
# with `publish --jsonl`, then `sluice run --exit-when-idle` under `perf record` (sampling every
# thread of the runner at 999 Hz). Prints the top frames by their own time (no children), by
# shared object and symbol, and the same grouped by thread name. With --rabbitmq the queue is
# a quorum queue on RabbitMQ at 127.0.0.1:5672 (a vhost of its own, deleted after); with
# --jetstream a stream on NATS JetStream at $NATS, default 127.0.0.1:4222 (a prefix of its own,
# its streams deleted after); else the embedded broker. Results are in BENCHMARKS.md.
#
#   scripts/profile-happy-path.sh [--rabbitmq|--jetstream] [SLUICE_BINARY] [MESSAGES]   # defaults: target/release/sluice 30000
set -euo pipefail
cd "$(dirname "$0")/.."
broker_kind=embedded
case ${1:-} in --rabbitmq | --jetstream) broker_kind=${1#--}; shift ;; esac
sluice=$(realpath "${1:-${CARGO_TARGET_DIR:-target}/release/sluice}")
messages=${2:-30000}
command -v perf >/dev/null || { echo "perf is not installed: apt-get install linux-perf" >&2; exit 1; }
source scripts/bench-lib.sh

happy_path "$sluice" "$messages"
mkdir -p "$tmp/run"
broker=()
case $broker_kind in
  rabbitmq)
    make_vhost "sluice-profile-$$"
    broker=(--broker "$url") ;;
  jetstream)
    nats_prefix=sluice-profile-$$
    broker=(--broker "nats://$nats?prefix=$nats_prefix") ;;
esac
cd "$tmp/run"
"$sluice" run "$tmp/p" "${broker[@]}" --exit-when-idle 2>/dev/null
"$sluice" publish "${broker[@]}" --exchange bench --routing-key work --type t --jsonl "$tmp/m.jsonl" >/dev/null 2>&1
start=$(date +%s.%N)
perf record -q -F 999 -o "$tmp/perf.data" -- "$sluice" run "$tmp/p" "${broker[@]}" --exit-when-idle 2>/dev/null
end=$(date +%s.%N)
python3 -c "print('drained $messages messages in', round($end - $start, 2), 's:', round($messages / ($end - $start)), 'messages/s under perf')"
echo "== top frames by own time (shared object, symbol)"
perf report -q -i "$tmp/perf.data" --no-children --stdio --sort dso,symbol --percent-limit 1 2>/dev/null | sed "/^$/d; s/ *-  *- *$//" | cut -c1-110 | head -20
echo "== by thread"
perf report -q -i "$tmp/perf.data" --no-children --stdio --sort comm --percent-limit 1 2>/dev/null | sed '/^$/d' | head -12
