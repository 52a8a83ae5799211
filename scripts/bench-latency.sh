#!/usr/bin/env bash
# Publish-to-webhook latency at a steady rate (issue 33 point 5): one webhook queue
# (concurrency 50, idempotency on; a quorum queue on RabbitMQ at 127.0.0.1:5672 in a vhost of
# its own), a paced publisher and a receiver that answers at once (scripts/bench-latency.py,
# needs pika: pip install pika), and `sluice run` between them. Prints the latency's
# percentiles and maximum after the first second. The run is RUNS times, fresh each time.
#
#   scripts/bench-latency.sh SLUICE [RATE] [SECONDS] [RUNS]   # defaults: 2000 30 3
set -euo pipefail
cd "$(dirname "$0")/.."
sluice=$(realpath "$1")
rate=${2:-2000} seconds=${3:-30} runs=${4:-3}
python3 -c 'import pika' 2>/dev/null || { echo "needs pika: python3 -m pip install pika" >&2; exit 1; }
source scripts/bench-lib.sh
echo "load average at the start $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$runs"); do
  make_vhost "sluice-bench-latency-$$-$i"
  port=$(free_port)
  mkdir -p "$tmp/run$i"
  bench_pipeline "$tmp/p$i" "$port"
  coproc measure { python3 scripts/bench-latency.py "$url" "$port" "$rate" "$seconds"; }
  read -r ready <&"${measure[0]}"
  [[ $ready == ready ]] || { echo "the receiver did not start" >&2; exit 1; }
  (cd "$tmp/run$i" && exec "$sluice" run "$tmp/p$i" --broker "$url" 2>/dev/null) &
  runner=$!
  echo "run $i:"
  cat <&"${measure[0]}"
  kill "$runner" 2>/dev/null || true
  wait "$runner" 2>/dev/null || true
  runner=""
  drop_vhost
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
