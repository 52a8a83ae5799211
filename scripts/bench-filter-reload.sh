#!/usr/bin/env bash
# A long `in:` list in a binding filter (issue 31 item 6): how long `sluice validate` takes on
# it, and how long another queue's deliveries stop while a reload adds it. The method and the
# latest figures are in BENCHMARKS.md ("A long `in:` list: validate and reload").
#
#   scripts/bench-filter-reload.sh AFTER_BINARY [BEFORE_BINARY]
#   RUNS=5 SIZES="2500 20000 40000" scripts/bench-filter-reload.sh target/release/sluice /tmp/sluice-old
#
# 1. Validate. For each size N in SIZES, one pipeline file with one queue whose binding filter
#    is `{field: payload.customer, in: [...]}` with N values on one line (numbers and `cN`
#    strings, alternating), and one with them one a line (a block list). Each binary validates
#    each file RUNS times, alternating binaries; the wall time of each run (`date +%s.%N` around
#    it) is printed and the median reported. A run taking longer than VALIDATE_LIMIT seconds is
#    stopped and reported as `>LIMIT`.
# 2. Reload. On an embedded broker in a directory of its own: queue `a` (concurrency 1) posts
#    each message to a local python3 receiver that records each request's arrival time
#    (`time.time()`) and answers after RECEIVER_DELAY seconds. A backlog of BACKLOG messages is
#    published (`sluice publish --jsonl`) before `sluice run DIR --admin ADDR` starts, so `a`
#    is served steadily with no publisher beside it. Once 200 requests have arrived, a second
#    file adding queue `big` with the RELOAD_SIZE-value filter is saved (a temporary file, then
#    a rename, as editors save). The figure is the longest gap between two requests of `a`
#    from the save until the reload is applied (`sluice_config_reloads_total{result="applied"}`
#    on /metrics, polled every 50 ms) plus one second, beside the median gap before the save.
#    RUNS runs per binary, alternating.
#
# Knobs (environment): RUNS=3 SIZES="2500 20000 40000" VALIDATE_LIMIT=600 RELOAD_SIZE=20000
# BACKLOG=40000 RECEIVER_DELAY=0.002 PARTS="validate reload". Needs python3.
set -euo pipefail

runs=${RUNS:-3} sizes=${SIZES:-2500 20000 40000} limit=${VALIDATE_LIMIT:-600}
reload_size=${RELOAD_SIZE:-20000} backlog=${BACKLOG:-40000} delay=${RECEIVER_DELAY:-0.002}
parts=${PARTS:-validate reload}

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 AFTER_BINARY [BEFORE_BINARY]" >&2
  exit 2
fi
declare -A bins=([after]=$(realpath "$1"))
labels=(after)
if [ $# -eq 2 ]; then
  bins[before]=$(realpath "$2")
  labels=(before after)
fi
for label in "${labels[@]}"; do
  [ -x "${bins[$label]}" ] || { echo "not an executable: ${bins[$label]}" >&2; exit 2; }
done

tmp=$(mktemp -d)
runner="" receiver=""
cleanup() {
  if [ -n "$runner" ]; then kill "$runner" 2>/dev/null || true; wait "$runner" 2>/dev/null || true; fi
  if [ -n "$receiver" ]; then kill "$receiver" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# gen.py N FORM QUEUE > FILE: a pipeline file whose queue QUEUE filters on an N-value list,
# FORM flow (one line) or block (one value a line), calling URL (default: nothing listens).
cat >"$tmp/gen.py" <<'PY'
import sys
n, form, queue = int(sys.argv[1]), sys.argv[2], sys.argv[3]
values = [str(i) if i % 2 == 0 else f"c{i}" for i in range(n)]
out = ["version: 1", "queues:", f"  {queue}:", "    bind:", "      - exchange: ev", '        routing_key: "none"',
       "        filter:", "          field: payload.customer"]
if form == "flow":
    out.append("          in: [" + ", ".join(values) + "]")
else:
    out.append("          in:")
    out.extend(f"            - {v}" for v in values)
out += ["    handler:", '      webhook: {url: "http://127.0.0.1:9/hook"}']
print("\n".join(out))
PY

median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2)}'; }

if [[ " $parts " == *" validate "* ]]; then
  echo "== validate: seconds per run (median of $runs)"
  for n in $sizes; do
    for form in flow block; do
      dir="$tmp/validate-$form-$n"
      mkdir -p "$dir"
      printf 'version: 1\nexchanges:\n  ev: {type: topic}\n' >"$dir/exchanges.yaml"
      python3 "$tmp/gen.py" "$n" "$form" big >"$dir/big.yaml"
      bytes=$(stat -c %s "$dir/big.yaml")
      declare -A times=()
      for _ in $(seq "$runs"); do
        for label in "${labels[@]}"; do
          start=$(date +%s.%N)
          if timeout "$limit" "${bins[$label]}" validate "$dir" >/dev/null 2>"$tmp/validate.err"; then
            t=$(echo "$(date +%s.%N) - $start" | bc)
          elif [ $? -eq 124 ]; then
            t=">$limit"
          else
            cat "$tmp/validate.err" >&2
            exit 1
          fi
          times[$label]+="$t "
        done
      done
      for label in "${labels[@]}"; do
        # shellcheck disable=SC2086
        echo "$label $form N=$n bytes=$bytes runs: ${times[$label]}median $(printf '%s\n' ${times[$label]//>/} | median)"
      done
      unset times
    done
  done
fi

if [[ " $parts " == *" reload "* ]]; then
  cat >"$tmp/receiver.py" <<'PY'
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

delay = float(sys.argv[1])
lock = threading.Lock()
arrivals = []

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        now = time.time()
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with lock:
            arrivals.append(now)
        if delay:
            time.sleep(delay)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        # /count, or /gaps?from=T&to=T: the longest gap between arrivals from T to T, and the
        # median gap of the 200 arrivals before the first T.
        with lock:
            times = sorted(arrivals)
        if self.path.startswith("/gaps"):
            query = dict(p.split("=") for p in self.path.split("?", 1)[1].split("&"))
            lo, hi = float(query["from"]), float(query["to"])
            inside = [t for t in times if lo <= t <= hi]
            before = [t for t in times if t < lo][-201:]
            edges = [max([t for t in times if t < lo], default=lo)] + inside + [min([t for t in times if t > hi], default=hi)]
            gaps = [b - a for a, b in zip(edges, edges[1:])]
            normal = sorted(b - a for a, b in zip(before, before[1:]))
            out = {"longest": max(gaps), "requests": len(inside),
                   "normal": normal[len(normal) // 2] if normal else None}
        else:
            out = len(times)
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
PY
  python3 - "$backlog" >"$tmp/backlog.jsonl" <<'PY'
import json, sys
for i in range(int(sys.argv[1])):
    print(json.dumps({"n": i}))
PY
  python3 "$tmp/gen.py" "$reload_size" flow big >"$tmp/big.yaml"
  metric() { curl -sf "http://$admin/metrics" | awk -v s="$1" '$1 == s {print $2}'; }
  echo "== reload of a $reload_size-value filter: another queue's longest pause (s)"
  declare -A pauses=()
  for run in $(seq "$runs"); do
    for label in "${labels[@]}"; do
      bin=${bins[$label]}
      work="$tmp/reload-$label-$run"
      mkdir -p "$work/pipelines"
      python3 -u "$tmp/receiver.py" "$delay" >"$work/port" &
      receiver=$!
      while [ ! -s "$work/port" ]; do sleep 0.05; done
      port=$(cat "$work/port")
      printf 'version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n  a:\n    bind: [{exchange: ev, routing_key: "#"}]\n    concurrency: 1\n    handler:\n      webhook: {url: "http://127.0.0.1:%s/hook"}\n' \
        "$port" >"$work/pipelines/a.yaml"
      "$bin" run "$work/pipelines" --broker "$work/broker" --exit-when-idle >/dev/null 2>&1
      "$bin" publish --exchange ev --routing-key k --type t --jsonl "$tmp/backlog.jsonl" --broker "$work/broker" 2>/dev/null
      admin=127.0.0.1:$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      "$bin" run "$work/pipelines" --broker "$work/broker" --admin "$admin" 2>"$work/run.log" &
      runner=$!
      until [ "$(curl -sf "http://127.0.0.1:$port/count" || echo 0)" -ge 200 ]; do sleep 0.05; done
      cp "$tmp/big.yaml" "$work/big.tmp"
      saved=$(date +%s.%N)
      mv "$work/big.tmp" "$work/pipelines/big.yaml"
      until [ "$(metric 'sluice_config_reloads_total{result="applied"}' || true)" = 1 ]; do
        kill -0 "$runner" || { cat "$work/run.log" >&2; exit 1; }
        sleep 0.05
      done
      applied=$(date +%s.%N)
      sleep 1
      gaps=$(curl -sf "http://127.0.0.1:$port/gaps?from=$saved&to=$(echo "$applied + 1" | bc)")
      kill "$runner"; wait "$runner" || true; runner=""
      kill "$receiver"; receiver=""
      longest=$(echo "$gaps" | python3 -c 'import json, sys; print(round(json.load(sys.stdin)["longest"], 3))')
      echo "$label run $run: save to applied $(echo "$applied - $saved" | bc) s; $gaps"
      pauses[$label]+="$longest "
    done
  done
  for label in "${labels[@]}"; do
    # shellcheck disable=SC2086
    echo "$label longest pauses: ${pauses[$label]}median $(printf '%s\n' ${pauses[$label]} | median)"
  done
fi
