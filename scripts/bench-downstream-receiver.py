#!/usr/bin/env python3
"""The webhook receiver of scripts/bench-downstream.sh (issue 13): a measuring device.

    bench-downstream-receiver.py PORT [CAPACITY SERVICE_MS]

Answers POSTs 200 after SERVICE_MS (default 0); with CAPACITY > 0, a request arriving while
CAPACITY are already in service gets 503 at once. POST /control/down makes it answer 503 to
everything until POST /control/up. GET /stats?since=EPOCH_SECONDS prints JSON: calls, calls
while down, 503s for capacity, successes, distinct keys succeeded, successes beyond the first
per key, when it last went up, and when a key first succeeded last (all since `since` where it
applies). GET /calls prints every call as [idempotency key, payload "k" of the JSON body (the
envelope; null without one), status, arrival time] in arrival order (scripts/soak.sh keeps its ledger with it).
HTTP/1.1 keep-alive, a thread per connection.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PORT = int(sys.argv[1])
CAPACITY = int(sys.argv[2]) if len(sys.argv) > 2 else 0
SERVICE = (int(sys.argv[3]) if len(sys.argv) > 3 else 0) / 1000.0

lock = threading.Lock()
state = {"down": False, "in_service": 0, "went_up": None, "last_first_success": None}
events = []  # (time, kind) with kind in call, down, rejected, success
succeeded = {}  # key -> successes
calls = []  # [key, payload k, status]


def payload_k(body):
    try:
        payload = json.loads(body).get("payload")
        return payload.get("k") if isinstance(payload, dict) else None
    except (ValueError, AttributeError):
        return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body=b""):
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/calls":
            with lock:
                data = json.dumps(calls).encode()
            return self.reply(200, data)
        since = float(parse_qs(urlparse(self.path).query).get("since", ["0"])[0])
        with lock:
            recent = [kind for at, kind in events if at >= since]
            stats = {
                "calls": recent.count("call"),
                "calls_while_down": recent.count("down"),
                "rejected": recent.count("rejected"),
                "successes": recent.count("success"),
                "keys": len(succeeded),
                "duplicates": sum(n - 1 for n in succeeded.values()),
                "went_up": state["went_up"],
                "last_first_success": state["last_first_success"],
                "now": time.time(),
            }
        self.reply(200, json.dumps(stats).encode())

    def do_POST(self):
        length = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(length) if length else b""
        if self.path.startswith("/control/"):
            with lock:
                state["down"] = self.path.endswith("/down")
                if not state["down"]:
                    state["went_up"] = time.time()
            return self.reply(200)
        key = self.headers.get("idempotency-key", "")
        now = time.time()
        with lock:
            events.append((now, "call"))
            if state["down"]:
                events.append((now, "down"))
                status = 503
            elif CAPACITY and state["in_service"] >= CAPACITY:
                events.append((now, "rejected"))
                status = 503
            else:
                state["in_service"] += 1
                status = 200
        with lock:
            calls.append([key, payload_k(body), status, now])
        if status == 200:
            if SERVICE:
                time.sleep(SERVICE)
            with lock:
                state["in_service"] -= 1
                done = time.time()
                events.append((done, "success"))
                succeeded[key] = succeeded.get(key, 0) + 1
                if succeeded[key] == 1:
                    state["last_first_success"] = done
        self.reply(status)


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 256
ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
