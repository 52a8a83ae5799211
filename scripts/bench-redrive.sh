#!/usr/bin/env bash
# Redrive rate of `sluice dlq redrive` (issue 11): MESSAGES dead-lettered messages sent back to
# their queue, each removed from the dead-letter queue only after its copy is confirmed. The
# method and the latest figures are in BENCHMARKS.md ("Redrive").
#
#   scripts/bench-redrive.sh SLUICE_BINARY
#   RUNS=5 MESSAGES=10000 scripts/bench-redrive.sh target/release/sluice
#
# Each run has a vhost of its own, deleted when the run ends (also on failure or Ctrl-C), and a
# pipeline with one queue `work` of type classic or quorum (both are measured, alternating).
# The binary declares the topology (`run --exit-when-idle` on the empty queue), fills
# `work.dlq` with `sluice publish --jsonl` (1 KB payloads, through the default exchange), then
# `sluice dlq redrive work` is timed as a whole process; the run checks that `work` then holds
# every message and `work.dlq` none. The fill is timed too, as the baseline: publishing the
# same messages with confirms is what the broker can take, and a redrive both reads and
# publishes them. Prints each run and the medians per queue type.
#
# Knobs (environment): RUNS=5 MESSAGES=10000. Needs RabbitMQ at 127.0.0.1:5672 (guest/guest)
# and rabbitmqctl.
set -euo pipefail

if [ $# -ne 1 ] || [ ! -x "$1" ]; then
  echo "usage: $0 SLUICE_BINARY" >&2
  exit 2
fi
sluice=$(realpath "$1")
runs=${RUNS:-5} messages=${MESSAGES:-10000}

source "$(dirname "$(realpath "$0")")/bench-lib.sh"

pad=$(head -c 1000 /dev/zero | tr '\0' x)
for i in $(seq "$messages"); do printf '{"n": %d, "pad": "%s"}\n' "$i" "$pad"; done >"$tmp/payloads.jsonl"

depth() { # QUEUE: ready messages, from `sluice status --format json`
  "$sluice" status "$tmp/p" --broker "$url" --format json |
    python3 -c "import json,sys; s=json.load(sys.stdin)['queues'][0]; print(s['$1'])"
}

declare -A rates fills
for run in $(seq "$runs"); do
  for kind in classic quorum; do
    make_vhost "sluice-bench-redrive-$$-$run-$kind"
    rm -rf "$tmp/p" && mkdir -p "$tmp/p"
    cat >"$tmp/p/pipeline.yaml" <<YAML
version: 1
exchanges:
  ev: {type: topic}
queues:
  work:
    type: $kind
    bind: [{exchange: ev, routing_key: "#"}]
    handler:
      webhook: {url: "http://127.0.0.1:9/never-called"}
YAML
    "$sluice" run "$tmp/p" --broker "$url" --exit-when-idle --dedup "$tmp/state" 2>/dev/null
    fill_start=$(date +%s.%N)
    "$sluice" publish --exchange "" --routing-key work.dlq --type bench.event \
      --jsonl "$tmp/payloads.jsonl" --broker "$url" 2>/dev/null
    fill_end=$(date +%s.%N)
    [ "$(depth dead_lettered)" = "$messages" ] || { echo "work.dlq not filled" >&2; exit 1; }
    start=$(date +%s.%N)
    "$sluice" dlq redrive work --pipelines "$tmp/p" --broker "$url" >/dev/null
    end=$(date +%s.%N)
    [ "$(depth ready)" = "$messages" ] && [ "$(depth dead_lettered)" = 0 ] ||
      { echo "run $run $kind: not every message moved" >&2; exit 1; }
    rate=$(python3 -c "print(round($messages / ($end - $start)))")
    fill=$(python3 -c "print(round($messages / ($fill_end - $fill_start)))")
    echo "run $run $kind: redrive $messages in $(python3 -c "print(round($end - $start, 3))") s = $rate msg/s; publish $fill msg/s"
    rates[$kind]+="$rate "
    fills[$kind]+="$fill "
    drop_vhost
  done
done
for kind in classic quorum; do
  python3 - "$kind" "${rates[$kind]}" "${fills[$kind]}" <<'PY'
import statistics, sys
kind, redrive, publish = sys.argv[1], sorted(map(int, sys.argv[2].split())), sorted(map(int, sys.argv[3].split()))
r, p = statistics.median(redrive), statistics.median(publish)
print(f"{kind}: redrive median {r:.0f} msg/s (min {redrive[0]}, max {redrive[-1]}); "
      f"publish median {p:.0f} msg/s; redrive / publish {r / p:.2f}")
PY
done
