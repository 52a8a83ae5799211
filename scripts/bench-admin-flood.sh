#!/usr/bin/env bash
# What an admin read flood costs the data path (issue 31 item 9): the same backlog drained on
# the embedded broker by `sluice run --admin` (concurrency 16, a webhook to `sluice
# demo-receiver`), once quiet and once while CONNECTIONS connections pipeline GET PATH at the
# admin port as fast as it answers (scripts/bench-admin-flood-client.py), runs alternating.
#
#   scripts/bench-admin-flood.sh [SLUICE_BINARY] [MESSAGES] [RUNS]   # defaults: target/release/sluice 20000 5
#
# Knobs (environment): CONNECTIONS=20, PATHS="/api/v1/queues" (several, space-separated, are
# flooded in turn by the connections), DEPTH=16 (requests in flight per connection), NICE=19
# (the flood client's niceness: it runs on the same cores, and at 19 it takes what the runner
# leaves instead of competing with it, as a flood from another machine would).
#
# Prints each run's load average (1 min) before it, wall time, messages per second (each is one
# webhook call), the runner's CPU seconds (user + system) and, with the flood, the admin answers
# read and their rate; then the medians and the ratios (flood / quiet). Results are in
# BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
sluice=$(realpath "${1:-${CARGO_TARGET_DIR:-target}/release/sluice}")
messages=${2:-20000}
runs=${3:-5}
connections=${CONNECTIONS:-20} paths=${PATHS:-/api/v1/queues} depth=${DEPTH:-16} niceness=${NICE:-19}
source scripts/bench-lib.sh
# The admin token of the runner and of the flood's requests (reads may need it).
export SLUICE_ADMIN_TOKEN=bench-admin-flood-token

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

# run_once quiet|flood: drains a fresh backlog with the admin port on; prints the wall seconds it
# took, the runner's CPU seconds, and the admin answers the flood read and in how long (0 0 when
# quiet).
run_once() {
  local broker="$tmp/broker-$1-$RANDOM" addr="127.0.0.1:$(port)" flooders=() out
  # An empty broker: the run declares the topology and exits at once.
  "$sluice" run "$tmp/p" --broker "$broker" --exit-when-idle --no-watch 2>/dev/null
  "$sluice" publish --exchange ev --routing-key x --type bench --jsonl "$tmp/payloads.jsonl" --broker "$broker" >/dev/null 2>&1
  /usr/bin/time -f '%e %U %S' -o "$tmp/time" \
    "$sluice" run "$tmp/p" --broker "$broker" --exit-when-idle --no-watch --admin "$addr" 2>/dev/null &
  runner=$!
  if [ "$1" = flood ]; then
    local n=0 each=$(( (connections + $(wc -w <<<"$paths") - 1) / $(wc -w <<<"$paths") ))
    for path in $paths; do
      nice -n "$niceness" python3 scripts/bench-admin-flood-client.py "$addr" "$each" "$path" "$depth" >"$tmp/flood-$n" &
      flooders+=($!)
      n=$((n + 1))
    done
  fi
  wait "$runner"
  runner=""
  local answered=0 seconds=0
  for pid in "${flooders[@]}"; do kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  for out in "$tmp"/flood-*; do
    [ -e "$out" ] || continue
    read -r a s _ <"$out"
    answered=$((answered + a)) seconds=$s
    rm -f "$out"
  done
  rm -rf "$broker"
  echo "$(awk '{print $1, $2 + $3}' "$tmp/time") $answered $seconds"
}

declare -a wall_quiet wall_flood cpu_quiet cpu_flood
for run in $(seq "$runs"); do
  for mode in quiet flood; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    read -r seconds cpu answered flood_seconds < <(run_once "$mode")
    rate=$(awk -v a="$answered" -v s="$flood_seconds" 'BEGIN { print (s > 0 ? a / s : 0) }')
    printf '%-5s run %d (load %5s): %6.2f s, %7.0f messages/s, %6.2f CPU s, %7d admin answers (%6.0f/s)\n' \
      "$mode" "$run" "$load" "$seconds" "$(echo "$messages / $seconds" | bc -l)" "$cpu" "$answered" "$rate"
    if [ "$mode" = flood ]; then wall_flood+=("$seconds") cpu_flood+=("$cpu"); else wall_quiet+=("$seconds") cpu_quiet+=("$cpu"); fi
  done
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m_quiet=$(median "${wall_quiet[@]}") m_flood=$(median "${wall_flood[@]}")
c_quiet=$(median "${cpu_quiet[@]}") c_flood=$(median "${cpu_flood[@]}")
printf 'median wall: quiet %.2f s (%.0f messages/s), flood %.2f s (%.0f messages/s); calls per second ratio (flood / quiet) %.3f\n' \
  "$m_quiet" "$(echo "$messages / $m_quiet" | bc -l)" "$m_flood" "$(echo "$messages / $m_flood" | bc -l)" \
  "$(echo "$m_quiet / $m_flood" | bc -l)"
printf 'median runner CPU: quiet %.2f s, flood %.2f s; ratio (flood / quiet) %.3f\n' \
  "$c_quiet" "$c_flood" "$(echo "$c_flood / $c_quiet" | bc -l)"
