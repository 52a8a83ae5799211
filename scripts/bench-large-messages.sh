#!/usr/bin/env bash
# Peak RSS of `sluice run` while 32 messages of 5 MB each are in flight at once (issue 9):
# memory should grow with the bytes in flight, not with a multiple of them. The method and the
# latest figures are in BENCHMARKS.md ("Memory: 32 in-flight 5 MB messages").
#
#   scripts/bench-large-messages.sh SLUICE_BINARY [MORE_BINARIES...]
#   RUNS=5 scripts/bench-large-messages.sh target/release/sluice /path/to/older/sluice
#
# Each run has a vhost of its own, deleted when the run ends (also on failure or Ctrl-C): one
# topic exchange `ev` and one classic queue `big` (concurrency 32, so prefetch 32) whose
# webhook posts the default body, the whole envelope, to a local receiver (python3, threaded)
# that reads the body, holds the request DELAY seconds, answers 200 and counts requests.
# The binary under test first declares the topology (`run --exit-when-idle` on the empty
# queue), then publishes the envelopes; only then does the measured `sluice run
# --exit-when-idle` start, so it is handed 32 at once. It runs under /usr/bin/time -v, whose
# "Maximum resident set size" is the figure. Binaries alternate run by run (A B A B ...).
#
# Knobs (environment): RUNS=3 MESSAGES=64 PAYLOAD_BYTES=5000000 CONCURRENCY=32 DELAY=3.
# Needs RabbitMQ at 127.0.0.1:5672 (guest/guest), rabbitmqctl, python3 and /usr/bin/time
# (Debian/Ubuntu package `time`).
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 SLUICE_BINARY [MORE_BINARIES...]" >&2
  exit 2
fi
runs=${RUNS:-3} messages=${MESSAGES:-64} payload_bytes=${PAYLOAD_BYTES:-5000000}
concurrency=${CONCURRENCY:-32} delay=${DELAY:-3}
binaries=()
for b in "$@"; do
  [ -x "$b" ] || { echo "not an executable: $b" >&2; exit 2; }
  binaries+=("$(realpath "$b")")
done
[ -x /usr/bin/time ] || { echo "/usr/bin/time is missing (apt-get install time)" >&2; exit 2; }

source "$(dirname "$(realpath "$0")")/bench-lib.sh"

# The receiver: one thread per request, so all CONCURRENCY requests are held at once.
# GET /stats answers the request count, the distinct envelope ids, the most requests held at
# once and the largest body.
cat >"$tmp/receiver.py" <<'PY'
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

delay = float(sys.argv[1])
lock = threading.Lock()
stats = {"requests": 0, "ids": set(), "in_flight": 0, "max_in_flight": 0, "max_body": 0}

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def do_POST(self):
        body = self.read_body()
        try:
            envelope_id = json.loads(body).get("id")
        except ValueError:
            envelope_id = None
        with lock:
            stats["requests"] += 1
            stats["ids"].add(envelope_id)
            stats["in_flight"] += 1
            stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
            stats["max_body"] = max(stats["max_body"], len(body))
        time.sleep(delay)
        with lock:
            stats["in_flight"] -= 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        with lock:
            out = dict(stats, ids=len(stats["ids"]))
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

server = Server(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
PY

# MESSAGES payloads of PAYLOAD_BYTES bytes, one per line, for `sluice publish --jsonl`.
python3 - "$tmp/payloads.jsonl" "$messages" "$payload_bytes" <<'PY'
import sys
path, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
line = '{"blob": "' + "x" * size + '"}\n'
with open(path, "w") as f:
    for _ in range(count):
        f.write(line)
PY

stats() { python3 -c 'import json, sys, urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1]))[sys.argv[2]])' "http://127.0.0.1:$port/stats" "$1"; }

# kbytes -> MiB with one decimal; m:ss.ss or h:mm:ss -> seconds.
mib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
seconds() { awk -F: '{ s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; printf "%.1f", s }' <<<"$1"; }
median() { sort -n | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

label() { printf "\\x$(printf %x $((65 + $1)))"; }

echo "# sluice run: peak RSS with $concurrency in-flight messages of $payload_bytes-byte payloads"
echo
echo "$(date -u '+%Y-%m-%d %H:%M UTC'); $messages messages published before the runner starts," \
  "concurrency $concurrency, receiver holds each request ${delay} s; classic queue; $runs runs per binary, alternating"
echo
for i in "${!binaries[@]}"; do
  echo "- $(label "$i"): ${binaries[$i]} ($("${binaries[$i]}" --version 2>/dev/null || echo '?'), sha256 $(sha256sum "${binaries[$i]}" | cut -c1-12))"
done
echo

declare -A rss wall
for ((run = 1; run <= runs; run++)); do
  for i in "${!binaries[@]}"; do
    bin=${binaries[$i]} name=$(label "$i")
    make_vhost "sluice-bench-large-$$-$run-$name"

    python3 "$tmp/receiver.py" "$delay" >"$tmp/port" &
    receiver=$!
    for _ in $(seq 50); do [ -s "$tmp/port" ] && break; sleep 0.1; done
    port=$(cat "$tmp/port")

    dir="$tmp/pipeline-$run-$name"
    mkdir -p "$dir"
    write_pipeline() {
      cat >"$dir/large.yaml" <<YAML
version: 1
exchanges:
  ev: {type: topic}
queues:
  big:
    type: classic
    bind: [{exchange: ev, routing_key: k}]
    concurrency: $concurrency
$1    handler:
      webhook:
        url: "http://127.0.0.1:$port/hook"
        timeout: 60s
YAML
    }
    # Binaries from before max_message_bytes reject the field; their limit is RabbitMQ's.
    write_pipeline "    max_message_bytes: 16MiB"$'\n'
    if ! "$bin" validate "$dir" >/dev/null 2>&1; then
      write_pipeline ""
      "$bin" validate "$dir" >/dev/null
    fi

    "$bin" run "$dir" --broker "$url" --exit-when-idle --dedup "$tmp/declare-state-$run-$name" 2>"$tmp/declare.log" ||
      { cat "$tmp/declare.log" >&2; exit 1; }
    "$bin" publish --exchange ev --routing-key k --type t --jsonl "$tmp/payloads.jsonl" --broker "$url" 2>"$tmp/publish.log" ||
      { cat "$tmp/publish.log" >&2; exit 1; }

    status=0
    /usr/bin/time -v -o "$tmp/time.txt" \
      "$bin" run "$dir" --broker "$url" --exit-when-idle --dedup "$dir/.state" 2>"$tmp/run.log" || status=$?
    if [ "$status" != 0 ]; then
      echo "run $run $name: sluice run exited $status" >&2
      tail -20 "$tmp/run.log" >&2
      exit 1
    fi
    kib=$(awk -F': ' '/Maximum resident set size/ { print $2 }' "$tmp/time.txt")
    secs=$(seconds "$(awk -F': ' '/Elapsed \(wall clock\)/ { print $2 }' "$tmp/time.txt")")
    requests=$(stats requests) ids=$(stats ids) held=$(stats max_in_flight) body=$(stats max_body)
    echo "- run $run, $name: peak RSS $(mib "$kib") MiB ($kib KiB), wall $secs s;" \
      "receiver: $requests requests, $ids distinct envelopes, at most $held held at once, largest body $body bytes"
    if [ "$requests" != "$messages" ] || [ "$ids" != "$messages" ]; then
      echo "run $run $name: the receiver got $requests requests for $ids envelopes, not $messages" >&2
      exit 1
    fi
    rss[$i]+="$kib " wall[$i]+="$secs "

    kill "$receiver" && wait "$receiver" 2>/dev/null || true
    receiver=""
    drop_vhost
  done
done

echo
printf '| binary |'
for ((run = 1; run <= runs; run++)); do printf ' run %d (MiB) |' "$run"; done
printf ' median peak RSS (MiB) | median wall (s) |\n| --- |'
for ((run = 1; run <= runs; run++)); do printf ' ---: |'; done
printf ' ---: | ---: |\n'
declare -A med
for i in "${!binaries[@]}"; do
  printf '| %s |' "$(label "$i")"
  for kib in ${rss[$i]}; do printf ' %s |' "$(mib "$kib")"; done
  med[$i]=$(tr ' ' '\n' <<<"${rss[$i]}" | grep . | median)
  printf ' **%s** | %s |\n' "$(mib "${med[$i]}")" "$(tr ' ' '\n' <<<"${wall[$i]}" | grep . | median | xargs printf '%.1f')"
done
if [ "${#binaries[@]}" -gt 1 ]; then
  echo
  for ((i = 1; i < ${#binaries[@]}; i++)); do
    echo "ratio of medians $(label 0) / $(label "$i"): $(awk -v a="${med[0]}" -v b="${med[$i]}" 'BEGIN { printf "%.2f", a / b }')"
  done
fi
