#!/usr/bin/env bash
# Protecting the downstream (issue 13): a receiver outage with the circuit breaker on and off,
# and adaptive concurrency against a sweep of fixed ones on a capacity-limited receiver. The
# method and the latest figures are in BENCHMARKS.md ("Protecting the downstream").
#
#   scripts/bench-downstream.sh SLUICE_BINARY
#   RUNS=3 scripts/bench-downstream.sh target/release/sluice
#
# Outage: 500 messages, 20 a second for 25 s (`sluice publish --jsonl` once a second), to a
# queue with concurrency 4 and the default retry policy; the receiver answers 503 to everything
# from 2 s to 22 s. Once with the breaker's defaults, once with `enabled: false`. Reported:
# messages dead-lettered, receiver calls during the outage, time from the receiver's recovery
# until the last message first succeeded, successes beyond one per key.
#
# Sweep: a backlog of BACKLOG messages; the receiver serves CAPACITY requests at once in
# SERVICE_MS each (503 at once beyond). For each fixed concurrency in FIXED and for
# `{max: 64, adaptive: true}`: a fresh vhost and runner, SETTLE seconds, then the receiver's
# successes per second and 503 share over MEASURE seconds. Medians over RUNS.
#
# Knobs (environment): RUNS=3 FIXED="5 10 20 30 40" CAPACITY=20 SERVICE_MS=100 BACKLOG=8000
# SETTLE=10 MEASURE=15. Needs RabbitMQ at 127.0.0.1:5672 (guest/guest), rabbitmqctl, python3.
set -euo pipefail

if [ $# -ne 1 ] || [ ! -x "$1" ]; then
  echo "usage: $0 SLUICE_BINARY" >&2
  exit 2
fi
sluice=$(realpath "$1")
here=$(dirname "$(realpath "$0")")
runs=${RUNS:-3} fixed=${FIXED:-"5 10 20 30 40"} capacity=${CAPACITY:-20} service=${SERVICE_MS:-100}
backlog=${BACKLOG:-8000} settle=${SETTLE:-10} measure=${MEASURE:-15}

source "$(dirname "$(realpath "$0")")/bench-lib.sh"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
stat() { # FIELD [SINCE]: one field of the receiver's /stats
  curl -s "http://127.0.0.1:$rport/stats?since=${2:-0}" | python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"
}
status() { # FIELD: one field of `sluice status` for the queue
  "$sluice" status "$tmp/p" --broker "$url" --format json |
    python3 -c "import json,sys; s=json.load(sys.stdin); q=s['queues'][0]; print(q.get('$1', s.get('$1')))"
}
start_receiver() { # [CAPACITY SERVICE_MS]
  rport=$(free_port)
  python3 "$here/bench-downstream-receiver.py" "$rport" "$@" &
  receiver=$!
  until curl -s "http://127.0.0.1:$rport/stats" >/dev/null; do sleep 0.1; done
}
stop_receiver() { kill "$receiver"; wait "$receiver" 2>/dev/null || true; receiver=""; }
new_vhost() { # NAME QUEUE-YAML: a vhost and a pipeline with exchange ev and queue work
  make_vhost "sluice-bench-downstream-$$-$1"
  rm -rf "$tmp/p" "$tmp/state" && mkdir -p "$tmp/p"
  printf 'version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n  work:\n    bind: [{exchange: ev, routing_key: "#"}]\n    handler:\n      webhook: {url: "http://127.0.0.1:%s/hook"}\n%s' \
    "$rport" "$2" >"$tmp/p/pipeline.yaml"
  "$sluice" run "$tmp/p" --broker "$url" --exit-when-idle --dedup "$tmp/state" 2>/dev/null
}
start_runner() {
  "$sluice" run "$tmp/p" --broker "$url" --dedup "$tmp/state" --no-watch 2>"$tmp/run.log" &
  runner=$!
}
stop_runner() { kill "$runner"; wait "$runner" 2>/dev/null || true; runner=""; }
median() { python3 -c "import statistics,sys; print(statistics.median(map(float, sys.argv[1:])))" "$@"; }

# Outage.
for second in $(seq 0 24); do
  for i in $(seq 0 19); do printf '{"n": %d}\n' $((second * 20 + i)); done >"$tmp/batch-$second.jsonl"
done
declare -A dead calls recovery duplicates
for run in $(seq "$runs"); do
  for breaker in on off; do
    start_receiver
    extra=""
    [ "$breaker" = off ] && extra="    circuit_breaker: {enabled: false}"$'\n'
    new_vhost "outage-$run-$breaker" "$extra"
    start_runner
    begin=$(date +%s.%N)
    for second in $(seq 0 24); do
      [ "$second" = 2 ] && curl -s -X POST "http://127.0.0.1:$rport/control/down" >/dev/null
      [ "$second" = 22 ] && curl -s -X POST "http://127.0.0.1:$rport/control/up" >/dev/null
      "$sluice" publish --exchange ev --routing-key x --type bench.event --jsonl "$tmp/batch-$second.jsonl" \
        --broker "$url" >/dev/null 2>&1
      python3 -c "import time; time.sleep(max(0, $begin + $second + 1 - time.time()))"
    done
    deadline=$((SECONDS + 300))
    while :; do
      keys=$(stat keys) dlq=$(status dead_lettered) waiting=$(status retries_waiting) ready=$(status ready)
      if [ $((keys + dlq)) -ge 500 ] && [ "$waiting" = 0 ] && [ "$ready" = 0 ]; then break; fi
      [ $SECONDS -lt $deadline ] || { echo "outage run $run ($breaker): $keys handled, $dlq dead-lettered after 300 s" >&2; exit 1; }
      sleep 1
    done
    stop_runner
    c=$(stat calls_while_down) d=$(stat duplicates)
    r=$(python3 -c "print(round(max(0, $(stat last_first_success) - $(stat went_up)), 1))")
    echo "outage run $run, breaker $breaker: $dlq dead-lettered, $c calls during the outage, recovered in $r s, $d duplicate successes"
    dead[$breaker]+="$dlq " calls[$breaker]+="$c " recovery[$breaker]+="$r " duplicates[$breaker]+="$d "
    drop_vhost
    stop_receiver
  done
done
for breaker in on off; do
  # shellcheck disable=SC2086
  echo "outage, breaker $breaker: median dead-lettered $(median ${dead[$breaker]}), calls during the outage $(median ${calls[$breaker]}), recovery $(median ${recovery[$breaker]}) s, duplicates $(median ${duplicates[$breaker]})"
done

# Sweep.
for i in $(seq "$backlog"); do printf '{"n": %d}\n' "$i"; done >"$tmp/backlog.jsonl"
declare -A served rejected
settings="$(for c in $fixed; do printf 'fixed-%s ' "$c"; done)adaptive"
start_receiver "$capacity" "$service"
for run in $(seq "$runs"); do
  for setting in $settings; do
    case "$setting" in
      adaptive) concurrency="{max: 64, adaptive: true}" ;;
      *) concurrency=${setting#fixed-} ;;
    esac
    new_vhost "sweep-$run-$setting" "    concurrency: $concurrency"$'\n'"    retry: {max_attempts: 50, initial: 100ms, max: 1s}"$'\n'
    "$sluice" publish --exchange ev --routing-key x --type bench.event --jsonl "$tmp/backlog.jsonl" \
      --broker "$url" >/dev/null 2>&1
    start_runner
    sleep "$settle"
    since=$(date +%s.%N)
    sleep "$measure"
    ok=$(stat successes "$since") no=$(stat rejected "$since") all=$(stat calls "$since")
    stop_runner
    rate=$(python3 -c "print(round($ok / $measure))")
    share=$(python3 -c "print(round(100 * $no / max(1, $all), 2))")
    echo "sweep run $run, $setting: $rate msg/s served, $share % of calls 503"
    served[$setting]+="$rate " rejected[$setting]+="$share "
    drop_vhost
  done
done
stop_receiver
best=0 best_setting=""
for setting in $settings; do
  # shellcheck disable=SC2086
  m=$(median ${served[$setting]})
  # shellcheck disable=SC2086
  echo "sweep, $setting: median $m msg/s served, median $(median ${rejected[$setting]}) % 503"
  if [ "$setting" != adaptive ] && python3 -c "import sys; sys.exit(0 if $m > $best else 1)"; then best=$m best_setting=$setting; fi
done
# shellcheck disable=SC2086
echo "adaptive / best fixed ($best_setting): $(python3 -c "print(round($(median ${served[adaptive]}) / $best, 2))")"
