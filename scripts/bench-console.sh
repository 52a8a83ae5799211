#!/usr/bin/env bash
# What the console costs the data path (issue 22): the same backlog drained on the embedded
# broker with `--admin` and the console's polling (GET /api/v1/queues and the queue's attempts
# every 2 s, as an open page does) against without `--admin`, runs alternating.
#
#   scripts/bench-console.sh [SLUICE_BINARY] [MESSAGES] [RUNS]   # defaults: target/release/sluice 20000 3
#
# Prints each run's wall time, messages per second and the runner's CPU seconds (user + system,
# which a machine loaded by others disturbs far less than wall time), then the ratios of the
# medians (with the console / without). Results are in BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
sluice=${1:-${CARGO_TARGET_DIR:-target}/release/sluice}
messages=${2:-20000}
runs=${3:-3}
source scripts/bench-lib.sh

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
receiver_port=$(port)
"$sluice" demo-receiver --listen "127.0.0.1:$receiver_port" >/dev/null &
receiver=$!
mkdir -p "$tmp/p"
cat >"$tmp/p/p.yaml" <<EOF
version: 1
exchanges:
  ev: {type: topic}
queues:
  work:
    bind: [{exchange: ev, routing_key: "#"}]
    concurrency: 16
    handler:
      webhook: {url: "http://127.0.0.1:$receiver_port/hook"}
EOF
for i in $(seq "$messages"); do printf '{"i":%d}\n' "$i"; done >"$tmp/payloads.jsonl"

# run_once with|without: drains a fresh backlog; prints the wall seconds it took and the
# runner's CPU seconds.
run_once() {
  local broker="$tmp/broker-$1-$RANDOM" admin=() poller=""
  # An empty broker: the run declares the topology and exits at once.
  "$sluice" run "$tmp/p" --broker "$broker" --exit-when-idle --no-watch 2>/dev/null
  "$sluice" publish --exchange ev --routing-key x --type bench --jsonl "$tmp/payloads.jsonl" --broker "$broker" >/dev/null 2>&1
  if [ "$1" = with ]; then
    local addr="127.0.0.1:$(port)"
    admin=(--admin "$addr")
    # The reads need the token the runner generates into the broker's directory.
    ( while sleep 2; do
        auth="Authorization: Bearer $(cat "$broker/admin-token" 2>/dev/null)"
        curl -s -H "$auth" "http://$addr/api/v1/queues" >/dev/null || true
        curl -s -H "$auth" "http://$addr/api/v1/queues/work/attempts" >/dev/null || true
      done ) &
    poller=$!
  fi
  /usr/bin/time -f '%e %U %S' -o "$tmp/time" \
    "$sluice" run "$tmp/p" --broker "$broker" --exit-when-idle --no-watch "${admin[@]}" 2>/dev/null
  if [ -n "$poller" ]; then kill "$poller" 2>/dev/null || true; wait "$poller" 2>/dev/null || true; fi
  rm -rf "$broker"
  awk '{print $1, $2 + $3}' "$tmp/time"
}

declare -a with without cpu_with cpu_without
for run in $(seq "$runs"); do
  for mode in without with; do
    read -r seconds cpu < <(run_once "$mode")
    printf '%-8s run %d: %6.2f s, %8.0f messages/s, %6.2f CPU s\n' "$mode" "$run" "$seconds" \
      "$(echo "$messages / $seconds" | bc -l)" "$cpu"
    if [ "$mode" = with ]; then with+=("$seconds") cpu_with+=("$cpu"); else without+=("$seconds") cpu_without+=("$cpu"); fi
  done
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m_with=$(median "${with[@]}") m_without=$(median "${without[@]}")
c_with=$(median "${cpu_with[@]}") c_without=$(median "${cpu_without[@]}")
printf 'median wall: without %.2f s, with the console %.2f s; throughput ratio (with / without) %.3f\n' \
  "$m_without" "$m_with" "$(echo "$m_without / $m_with" | bc -l)"
printf 'median CPU: without %.2f s, with the console %.2f s; messages per CPU second ratio %.3f\n' \
  "$c_without" "$c_with" "$(echo "$c_without / $c_with" | bc -l)"
