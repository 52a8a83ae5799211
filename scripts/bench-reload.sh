#!/usr/bin/env bash
# Hot reload (issue 10): how long from saving a pipeline file until the new worker consumes,
# and what a reload every second costs a queue draining under load. The method and the latest
# figures are in BENCHMARKS.md ("Hot reload (issue 10)").
#
#   scripts/bench-reload.sh [SLUICE_BINARY]
#   RUNS=5 scripts/bench-reload.sh /path/to/sluice
#
# SLUICE_BINARY defaults to target/release/sluice of this checkout, which is built first
# (`cargo build --release --bin sluice`) if it is older than the checkout's newest commit.
#
# Both parts give every run a vhost of its own, deleted when the run ends (also on failure or
# Ctrl-C), with one topic exchange `ev` and one classic queue `work` whose webhook posts the
# default body to a local receiver: one threaded python3 HTTP server listening on two ports
# (A and B) that records, per port, each request's arrival time (`time.time()`) and its
# `idempotency-key` header, then waits DELAY seconds and answers 200. The binary under test
# first declares the topology (`run --exit-when-idle` on the empty queue), then the backlog is
# published with `sluice publish --jsonl`, then the measured `sluice run DIR --admin ADDR`
# starts (watching DIR, the default).
#
# 1. Save to new worker consuming. Queue `work` at concurrency 1 posts to port A; the receiver
#    holds each request LATENCY_DELAY (10 ms), so the runner drains a LATENCY_BACKLOG-message
#    backlog at one request every ~11-13 ms: a steady flow that needs no publisher running
#    beside it, and a backlog means the new consumer is handed a message the moment it
#    subscribes. RELOADS times, alternating A -> B -> A ..., the file is rewritten (a temporary
#    file, then os.replace; the save time is taken just before os.replace) and the latency is
#    the arrival time of the first request at the new port after the save minus the save time.
#    The next save waits SETTLE seconds after that arrival.
# 2. Throughput dip. A MESSAGES-message backlog drained at concurrency CONCURRENCY (the
#    receiver answers at once), with no reloads vs. with a reload every INTERVAL seconds that
#    flips concurrency between CONCURRENCY and CONCURRENCY+1 (so the queue is drained and
#    restarted each time), RUNS runs each, alternating. Messages/s = (MESSAGES - 1) / (last
#    arrival - first arrival) at the receiver. Every run checks that the receiver got MESSAGES
#    requests with MESSAGES distinct idempotency keys, that no message is left in any queue of
#    the vhost, and that sluice_config_reloads_total (from /metrics) has one applied reload per
#    save. Both variants wait for the drain in the same poller, so they share its cost.
#
# Knobs (environment): RELOADS=20 LATENCY_BACKLOG=6000 LATENCY_DELAY=0.01 SETTLE=1.0
# RUNS=3 MESSAGES=20000 CONCURRENCY=16 INTERVAL=1.0 PARTS="latency throughput".
# Needs RabbitMQ at 127.0.0.1:5672 (guest/guest), rabbitmqctl and python3.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
reloads=${RELOADS:-20} latency_backlog=${LATENCY_BACKLOG:-6000} latency_delay=${LATENCY_DELAY:-0.01}
settle=${SETTLE:-1.0} runs=${RUNS:-3} messages=${MESSAGES:-20000} concurrency=${CONCURRENCY:-16}
interval=${INTERVAL:-1.0} parts=${PARTS:-latency throughput}

if [ $# -gt 1 ]; then
  echo "usage: $0 [SLUICE_BINARY]" >&2
  exit 2
fi
if [ $# -eq 1 ]; then
  bin=$1
else
  bin="$repo/target/release/sluice"
  newest=$(git -C "$repo" log -1 --format=%ct)
  if [ ! -x "$bin" ] || [ "$(stat -c %Y "$bin")" -lt "$newest" ]; then
    echo "building $bin (missing or older than $(git -C "$repo" rev-parse --short HEAD))" >&2
    (cd "$repo" && cargo build --release --bin sluice) >&2
  fi
fi
[ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }
bin=$(realpath "$bin")

source "$(dirname "$(realpath "$0")")/bench-lib.sh"

# The receiver: two ports, one thread per connection. GET /stats answers the request count,
# the distinct idempotency keys, the first and last arrival, and per port the count and last
# arrival; GET /first?port=P&after=T the first arrival at port P after T (null if none yet);
# GET /gaps the gaps between consecutive arrivals (any port), sorted.
cat >"$tmp/receiver.py" <<'PY'
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

delay = float(sys.argv[1])
lock = threading.Lock()
arrivals = {}  # port -> [(time, key)]
keys = set()
duplicates = [0]

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        now = time.time()
        key = self.headers.get("idempotency-key")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                self.rfile.read(size)
                self.rfile.readline()
        else:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
        port = self.server.server_address[1]
        with lock:
            arrivals.setdefault(port, []).append((now, key))
            if key in keys:
                duplicates[0] += 1
            keys.add(key)
        if delay:
            time.sleep(delay)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        with lock:
            if url.path == "/first":
                port, after = int(query["port"]), float(query["after"])
                out = next((t for t, _ in arrivals.get(port, []) if t >= after), None)
            elif url.path == "/gaps":
                times = sorted(t for a in arrivals.values() for t, _ in a)
                out = sorted(b - a for a, b in zip(times, times[1:]))
            else:
                times = [t for a in arrivals.values() for t, _ in a]
                out = {
                    "requests": len(times),
                    "keys": len(keys),
                    "duplicates": duplicates[0],
                    "first": min(times, default=None),
                    "last": max(times, default=None),
                    "ports": {p: {"requests": len(a), "last": a[-1][0]} for p, a in arrivals.items()},
                }
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

servers = [Server(("127.0.0.1", 0), Handler) for _ in range(2)]
for s in servers:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print(" ".join(str(s.server_address[1]) for s in servers), flush=True)
threading.Event().wait()
PY

# Saves the pipeline the way an editor does (temporary file, then rename) and measures.
#   saver.py latency FILE TEMPLATE RECEIVER PORT_A PORT_B RELOADS SETTLE
#   saver.py drain FILE TEMPLATE RECEIVER CONCURRENCY INTERVAL MESSAGES PORT RELOAD
# TEMPLATE has @PORT@ and @CONCURRENCY@ in it.
cat >"$tmp/saver.py" <<'PY'
import json, os, sys, time, urllib.request

mode, path, template, receiver = sys.argv[1:5]
template = open(template).read()

def get(route):
    return json.load(urllib.request.urlopen(receiver + route))

def save(port, concurrency):
    text = template.replace("@PORT@", str(port)).replace("@CONCURRENCY@", str(concurrency))
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    saved = time.time()
    os.replace(path + ".tmp", path)
    return saved

if mode == "latency":
    ports = [int(sys.argv[5]), int(sys.argv[6])]
    count, settle = int(sys.argv[7]), float(sys.argv[8])
    for i in range(1, count + 1):
        old, new = ports[(i - 1) % 2], ports[i % 2]
        saved = save(new, 1)
        first = None
        while time.time() < saved + 15:
            first = get(f"/first?port={new}&after={saved}")
            if first is not None:
                break
            time.sleep(0.005)
        if first is None:
            sys.exit(f"reload {i}: no request reached port {new} within 15 s of the save")
        # The old worker's last request (it drains before the new worker starts).
        last_old = get("/stats")["ports"][str(old)]["last"]
        print(f"{i} {'AB'[i % 2]} {(first - saved) * 1000:.1f} {(last_old - saved) * 1000:.1f} "
              f"{(first - last_old) * 1000:.1f} {saved!r}", flush=True)
        time.sleep(max(0.0, first + settle - time.time()))
elif mode == "drain":
    # Both variants wait here (one process polling every 0.1 s), so they share its cost; with
    # RELOAD=1 it also saves every INTERVAL s from the first request on, flipping concurrency.
    base, every, total = int(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
    port, reload = int(sys.argv[8]), sys.argv[9] == "1"
    deadline = time.time() + 300
    while get("/stats")["requests"] == 0:
        if time.time() > deadline:
            sys.exit("no request reached the receiver")
        time.sleep(0.05)
    saves, next_save = 0, time.time() + every
    while get("/stats")["requests"] < total:
        if time.time() > deadline:
            sys.exit("the backlog did not drain within 300 s")
        if reload and time.time() >= next_save:
            saves += 1
            save(port, base + saves % 2)
            next_save += every
        time.sleep(0.1)
    print(saves, flush=True)
PY

# One payload per line, each message its own envelope (so its own idempotency key).
jsonl() { python3 -c 'import sys; sys.stdout.writelines("{\"n\": %d}\n" % i for i in range(int(sys.argv[1])))' "$1"; }
jsonl "$latency_backlog" >"$tmp/latency.jsonl"
jsonl "$messages" >"$tmp/throughput.jsonl"

stat_of() { python3 -c 'import json, sys, urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1]))[sys.argv[2]])' "$receiver_url/stats" "$1"; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
metric() {
  python3 - "$1" "$2" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1]).read().decode()
m = re.search(r'^sluice_config_reloads_total\{result="%s"\} (\S+)$' % sys.argv[2], text, re.M)
print(int(float(m.group(1))) if m else 0)
PY
}
median() { sort -n | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# start_run NAME DELAY: a vhost, the receiver, the pipeline directory; sets url, port_a,
# port_b, receiver_url, dir, admin.
start_run() {
  make_vhost "sluice-bench-reload-$$-$1"
  : >"$tmp/ports"
  python3 "$tmp/receiver.py" "$2" >"$tmp/ports" &
  receiver=$!
  for _ in $(seq 50); do [ -s "$tmp/ports" ] && break; sleep 0.1; done
  read -r port_a port_b <"$tmp/ports"
  receiver_url="http://127.0.0.1:$port_a"
  dir="$tmp/pipeline-$1"
  mkdir -p "$dir"
  cat >"$tmp/template.yaml" <<'YAML'
version: 1
exchanges:
  ev: {type: topic}
queues:
  work:
    type: classic
    bind: [{exchange: ev, routing_key: k}]
    concurrency: @CONCURRENCY@
    handler:
      webhook:
        url: "http://127.0.0.1:@PORT@/hook"
        timeout: 30s
YAML
  admin="127.0.0.1:$(free_port)"
}

# declare_and_publish JSONL CONCURRENCY
declare_and_publish() {
  sed -e "s/@PORT@/$port_a/" -e "s/@CONCURRENCY@/$2/" "$tmp/template.yaml" >"$dir/reload.yaml"
  "$bin" validate "$dir" >"$tmp/validate.log" 2>&1 || { cat "$tmp/validate.log" >&2; exit 1; }
  "$bin" run "$dir" --broker "$url" --exit-when-idle --no-watch --dedup "$tmp/declare-state-$vhost" 2>"$tmp/declare.log" ||
    { cat "$tmp/declare.log" >&2; exit 1; }
  "$bin" publish --exchange ev --routing-key k --type t --jsonl "$1" --broker "$url" 2>"$tmp/publish.log" ||
    { cat "$tmp/publish.log" >&2; exit 1; }
}

# The idempotency store lives outside the watched directory: the watcher takes a new directory
# under DIR (the store's) for a change and reloads once, a no-op, as the runner starts.
start_runner() {
  runlog="$tmp/run-$vhost.log"
  "$bin" run "$dir" --broker "$url" --dedup "$tmp/state-$vhost" --admin "$admin" 2>"$runlog" &
  runner=$!
}

stop_run() {
  kill -TERM "$runner"
  local status=0
  wait "$runner" || status=$?
  runner=""
  if [ "$status" != 0 ]; then
    echo "sluice run exited $status" >&2
    tail -20 "$runlog" >&2
    exit 1
  fi
  kill "$receiver" && wait "$receiver" 2>/dev/null || true
  receiver=""
}

end_run() {
  drop_vhost
}

# Messages left in any queue of the vhost (ready + unacked).
left_in_vhost() { rabbitmqctl -q list_queues -p "$vhost" --no-table-headers messages | awk '{ s += $1 } END { print s + 0 }'; }

echo "# sluice run: hot reload (issue 10)"
echo
echo "$(date -u '+%Y-%m-%d %H:%M UTC'); binary $bin ($("$bin" --version), sha256 $(sha256sum "$bin" | cut -c1-12));" \
  "checkout $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- src Cargo.toml Cargo.lock || echo ' (src modified)');" \
  "$(nproc) CPUs, load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"

if [[ " $parts " == *" latency "* ]]; then
  echo
  echo "## Save to new worker consuming: $reloads reloads"
  echo
  echo "Queue \`work\`, classic, concurrency 1; receiver holds each request $latency_delay s;" \
    "$latency_backlog-message backlog; each save alternates the URL between ports A and B;" \
    "next save $settle s after the new port's first request."
  echo
  start_run latency "$latency_delay"
  declare_and_publish "$tmp/latency.jsonl" 1
  start_runner
  # Warm up: the flow is steady before the first save.
  for _ in $(seq 100); do [ "$(stat_of requests)" -ge 50 ] && break; sleep 0.1; done
  [ "$(stat_of requests)" -ge 50 ] || { echo "the runner does not consume" >&2; tail -20 "$runlog" >&2; exit 1; }
  python3 "$tmp/saver.py" latency "$dir/reload.yaml" "$tmp/template.yaml" "$receiver_url" \
    "$port_a" "$port_b" "$reloads" "$settle" >"$tmp/latency.txt"
  applied=$(metric "http://$admin/metrics" applied) rejected=$(metric "http://$admin/metrics" rejected)
  python3 -c 'import json, sys, urllib.request; print(json.dumps(json.load(urllib.request.urlopen(sys.argv[1]))))' \
    "$receiver_url/gaps" >"$tmp/gaps.json"
  gaps=$(python3 - "$tmp/gaps.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
# The gaps of the steady flow: all but the largest few (one pause per reload).
print("median %.1f ms, 90th percentile %.1f ms, 99th percentile %.1f ms over %d gaps" % (
    g[len(g) // 2] * 1000, g[len(g) * 9 // 10] * 1000, g[len(g) * 99 // 100] * 1000, len(g)))
PY
)
  read -r requests keys duplicates < <(python3 -c '
import json, sys, urllib.request
s = json.load(urllib.request.urlopen(sys.argv[1]))
print(s["requests"], s["keys"], s["duplicates"])' "$receiver_url/stats")
  left=$(left_in_vhost)
  stop_run
  end_run
  # The runner's log says when the debounced request reached the loader ("reloading") and when
  # the new config was applied (old worker drained, new one subscribed): one of each per save.
  echo "| reload | new port | save -> first request at the new port (ms) | save -> \"reloading\" logged (ms) | save -> \"reload applied\" logged (ms) | save -> old port's last request (ms) | old port's last -> new port's first (ms) |"
  echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"
  python3 - "$tmp/latency.txt" "$runlog" <<'PY'
import re, sys
from datetime import datetime
log = re.sub(r"\x1b\[[0-9;]*m", "", open(sys.argv[2]).read())
def times(message):
    return [datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
            for m in re.finditer(r"^(\S+) +INFO .*" + re.escape(message), log, re.M)]
reloading, applied = times("pipeline files changed; reloading"), times("reload applied")
rows = [line.split() for line in open(sys.argv[1])]
if len(reloading) != len(rows) or len(applied) != len(rows):
    sys.exit(f"{len(rows)} saves but {len(reloading)} reloads and {len(applied)} applied in the runner's log")
for (i, port, latency, old, pause, saved), r, a in zip(rows, reloading, applied):
    saved = float(saved)
    print(f"| {i} | {port} | {latency} | {(r - saved) * 1000:.1f} | {(a - saved) * 1000:.1f} | {old} | {pause} |")
PY
  echo
  awk '{ print $3 }' "$tmp/latency.txt" | sort -n >"$tmp/lat-sorted.txt"
  echo "save -> new worker's first request: median $(median <"$tmp/lat-sorted.txt") ms," \
    "worst $(tail -1 "$tmp/lat-sorted.txt") ms, best $(head -1 "$tmp/lat-sorted.txt") ms" \
    "(goal: under 1000 ms including the debounce)"
  echo "old port's last -> new port's first request (the restart pause): median $(awk '{ print $5 }' "$tmp/latency.txt" | median) ms"
  echo "gaps between consecutive requests during the whole run: $gaps"
  echo "reloads applied $applied, rejected $rejected (sluice_config_reloads_total);" \
    "receiver: $requests requests, $keys distinct keys, $duplicates duplicates; $left messages left in the backlog"
  if [ "$applied" != "$reloads" ] || [ "$rejected" != 0 ] || [ "$duplicates" != 0 ] || [ "$left" -le 0 ]; then
    echo "latency part: expected $reloads applied, 0 rejected, no duplicates and a backlog left" >&2
    exit 1
  fi
fi

if [[ " $parts " == *" throughput "* ]]; then
  echo
  echo "## Throughput during reloads: $messages-message backlog, concurrency $concurrency"
  echo
  echo "No reloads vs. a reload every $interval s (concurrency $concurrency <-> $((concurrency + 1)));" \
    "receiver answers at once; $runs runs each, alternating."
  echo
  echo "| run | variant | msg/s | drain (s) | longest gap (ms) | gaps > 5 ms, summed (ms) | saves | reloads applied | rejected | requests | distinct keys | left in queues |"
  echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  declare -A rate
  for ((run = 1; run <= runs; run++)); do
    for variant in none reload; do
      start_run "$variant-$run" 0
      declare_and_publish "$tmp/throughput.jsonl" "$concurrency"
      start_runner
      saves=$(python3 "$tmp/saver.py" drain "$dir/reload.yaml" "$tmp/template.yaml" "$receiver_url" \
        "$concurrency" "$interval" "$messages" "$port_a" "$([ "$variant" = reload ] && echo 1 || echo 0)")
      sleep 1 # late duplicates, and the last acks
      applied=$(metric "http://$admin/metrics" applied) rejected=$(metric "http://$admin/metrics" rejected)
      # The gaps between consecutive requests show where the time went: the longest one, and
      # the sum of those over 5 ms (at ~2,000 msg/s requests come ~0.5 ms apart).
      read -r requests keys first last longest stalled < <(python3 -c '
import json, sys, urllib.request
s = json.load(urllib.request.urlopen(sys.argv[1] + "/stats"))
g = json.load(urllib.request.urlopen(sys.argv[1] + "/gaps"))
print(s["requests"], s["keys"], repr(s["first"]), repr(s["last"]),
      "%.0f" % (max(g) * 1000), "%.0f" % (sum(x for x in g if x > 0.005) * 1000))' "$receiver_url")
      stop_run
      left=$(left_in_vhost)
      end_run
      secs=$(awk -v a="$first" -v b="$last" 'BEGIN { printf "%.3f", b - a }')
      r=$(awk -v n="$messages" -v s="$secs" 'BEGIN { printf "%.0f", (n - 1) / s }')
      rate[$variant]+="$r "
      echo "| $run | $variant | $r | $secs | $longest | $stalled | $saves | $applied | $rejected | $requests | $keys | $left |"
      if [ "$requests" != "$messages" ] || [ "$keys" != "$messages" ] || [ "$left" != 0 ] || [ "$rejected" != 0 ] ||
        [ "$applied" != "$saves" ]; then
        echo "run $run $variant: expected $messages requests with as many distinct keys, nothing left, one applied reload per save" >&2
        exit 1
      fi
    done
  done
  echo
  m_none=$(tr ' ' '\n' <<<"${rate[none]}" | grep . | median)
  m_reload=$(tr ' ' '\n' <<<"${rate[reload]}" | grep . | median)
  per_run=$(paste -d' ' <(tr ' ' '\n' <<<"${rate[reload]}" | grep .) <(tr ' ' '\n' <<<"${rate[none]}" | grep .) |
    awk '{ printf "%s%.2f", (NR > 1 ? ", " : ""), $1 / $2 }')
  echo "median msg/s: no reloads $m_none, reload every $interval s $m_reload;" \
    "ratio of medians reload / none $(awk -v a="$m_reload" -v b="$m_none" 'BEGIN { printf "%.2f", a / b }')" \
    "(per run $per_run)"
fi
echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
