#!/usr/bin/env bash
# Issue 37's cluster benchmark: the webhook pipeline with six queues (each concurrency 20,
# idempotency on, to `sluice demo-receiver`) on a Redis Cluster of three primaries with a
# replica each, started here on free ports, side by side with the same on one Redis server
# (also started here, so that both sides run the same redis-server with the same settings).
# Each run: a fresh key prefix, MESSAGES published with `publish --jsonl` (a sixth to each
# queue), then `run --exit-when-idle` timed as a whole process. The sides alternate; the
# ratios of the medians come last, then the commands each node ran in the last cluster run
# (INFO commandstats): the queues spread over the primaries. With WAIT=1 a third side runs on
# the cluster with `?wait=1` (a publish and an ack wait for a replica): what it costs.
#
#   [WAIT=1] scripts/bench-redis-cluster.sh SLUICE [MESSAGES] [RUNS]   # defaults: 30000 5
set -euo pipefail
cd "$(dirname "$0")/.."
sluice=$(realpath "$1")
messages=${2:-30000}
runs=${3:-5}
source scripts/bench-lib.sh

servers=()
stop_servers() { for pid in "${servers[@]}"; do kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done; }
trap 'stop_servers; bench_cleanup' EXIT

# start_node PORT [ARGS...]: a redis-server keeping nothing on disk, in $tmp/PORT.
start_node() {
  local port=$1
  shift
  mkdir -p "$tmp/$port"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$tmp/$port" --save "" --appendonly no \
    --maxmemory-policy noeviction --repl-diskless-sync yes --repl-diskless-sync-delay 0 \
    --logfile "$tmp/$port/log" "$@" &
  servers+=($!)
  for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && return; sleep 0.05; done
  echo "redis-server on $port did not start" >&2
  exit 1
}

single=$(free_port)
start_node "$single"
nodes=()
for _ in 1 2 3 4 5 6; do
  port=$(free_port)
  # The bus port is given: the default, the port + 10000, may be taken or past 65535.
  start_node "$port" --cluster-enabled yes --cluster-port "$(free_port)" --cluster-node-timeout 1000 \
    --cluster-require-full-coverage no --cluster-config-file "nodes-$port.conf"
  nodes+=("127.0.0.1:$port")
done
redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
for node in "${nodes[@]}"; do
  for _ in $(seq 200); do
    redis-cli -p "${node#*:}" cluster info | grep -q 'cluster_state:ok' && break
    sleep 0.1
  done
done
cluster_url="redis+cluster://$(IFS=,; echo "${nodes[*]}")"

port=$(free_port)
"$sluice" demo-receiver --listen "127.0.0.1:$port" >/dev/null &
receiver=$!
mkdir -p "$tmp/p"
{
  printf 'version: 1\nexchanges:\n  bench: {type: direct}\nqueues:\n'
  for q in 0 1 2 3 4 5; do
    printf '  bench.q%s:\n    bind: [{exchange: bench, routing_key: q%s}]\n    concurrency: 20\n    handler:\n      webhook: {url: "http://127.0.0.1:%s/hook"}\n' "$q" "$q" "$port"
  done
} >"$tmp/p/p.yaml"
python3 -c "
import json
with open('$tmp/m.jsonl', 'w') as f:
    for i in range($messages // 6): f.write(json.dumps({'n': i, 'pad': 'x' * 100}) + '\n')"

# run_once SIDE: prints messages/s, CPU seconds (user + system) and peak RSS (MiB) of one drain.
run_once() {
  local dir url
  dir=$(mktemp -d "$tmp/run.XXXX")
  case $1 in
    single) url="redis://127.0.0.1:$single/?prefix=b${dir##*.}:" ;;
    cluster) url="$cluster_url?prefix=b${dir##*.}:" ;;
    cluster+wait) url="$cluster_url?prefix=b${dir##*.}:&wait=1" ;;
  esac
  (cd "$dir" && "$sluice" run "$tmp/p" --broker "$url" --exit-when-idle 2>/dev/null &&
    for q in 0 1 2 3 4 5; do
      "$sluice" publish --broker "$url" --exchange bench --routing-key "q$q" --type t --jsonl "$tmp/m.jsonl" >/dev/null 2>&1
    done)
  for node in "${nodes[@]}"; do redis-cli -p "${node#*:}" config resetstat >/dev/null; done
  local start end
  start=$(date +%s.%N)
  (cd "$dir" && /usr/bin/time -f "%U %S %M" -o "$dir/time" "$sluice" run "$tmp/p" --broker "$url" --exit-when-idle 2>/dev/null)
  end=$(date +%s.%N)
  local drained=$((messages / 6 * 6))
  python3 -c "u, s, m = open('$dir/time').read().split(); print(round($drained / ($end - $start)), round(float(u) + float(s), 2), round(int(m) / 1024))"
  rm -rf "$dir"
}

echo "sluice: $sluice; $messages messages over 6 queues; load average $(cut -d' ' -f1-3 /proc/loadavg)"
results=()
sides=(single cluster)
[[ ${WAIT:-} == 1 ]] && sides+=(cluster+wait)
for i in $(seq "$runs"); do
  for side in "${sides[@]}"; do
    read -r rate cpu rss < <(run_once "$side")
    printf '%-7s run %d: %6d messages/s, %5.2f CPU s, %4d MiB peak RSS\n' "$side" "$i" "$rate" "$cpu" "$rss"
    results+=("$side $rate $cpu $rss")
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
echo "commands per node in the last drain on the cluster (INFO commandstats, calls):"
for node in "${nodes[@]}"; do
  role=$(redis-cli -p "${node#*:}" info replication | tr -d '\r' | sed -n 's/^role://p')
  calls=$(redis-cli -p "${node#*:}" info commandstats | tr -d '\r' | sed -n 's/^cmdstat_[^:]*:calls=\([0-9]*\),.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
  echo "  $node ($role): ${calls:-0}"
done
printf '%s\n' "${results[@]}" | python3 -c "
import sys, statistics as st
rows = [l.split() for l in sys.stdin]
med = lambda b, i: st.median(float(r[i]) for r in rows if r[0] == b)
singles = [float(r[1]) for r in rows if r[0] == 'single']
clusters = [float(r[1]) for r in rows if r[0] == 'cluster']
n = $messages // 6 * 6
for side in ('single', 'cluster', 'cluster+wait'):
    if not any(r[0] == side for r in rows): continue
    print(f'median {side}: {med(side, 1):.0f} msg/s, {med(side, 2):.2f} CPU s ({med(side, 2) / n * 1e6:.0f} CPU µs per message), {med(side, 3):.0f} MiB')
print('per-run cluster / single: ' + ', '.join(f'{c / s:.2f}' for s, c in zip(singles, clusters)))
print(f'throughput cluster / single {med(\"cluster\", 1) / med(\"single\", 1):.3f}; CPU per message cluster / single {med(\"cluster\", 2) / med(\"single\", 2):.3f}')
if any(r[0] == 'cluster+wait' for r in rows):
    print(f'throughput cluster with ?wait=1 / cluster {med(\"cluster+wait\", 1) / med(\"cluster\", 1):.3f}')"
