#!/usr/bin/env python3
"""The admin read flood of scripts/bench-admin-flood.sh (issue 31 item 9).

    bench-admin-flood-client.py HOST:PORT [CONNECTIONS [PATH [DEPTH]]]

Opens CONNECTIONS (default 20) connections to the admin port and on each sends GET PATH
(default /api/v1/queues) DEPTH (default 16) at a time, pipelined, reading the answers before
sending the next DEPTH, until SIGTERM or SIGINT; a connection the port closes is opened again.
With $SLUICE_ADMIN_TOKEN set, each request carries it as a bearer token. Then prints one line:
answers read, how long it ran, and their statuses.
"""

import os
import signal
import socket
import sys
import threading
import time
from collections import Counter

HOST, PORT = sys.argv[1].rsplit(":", 1)
CONNECTIONS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
PATH = sys.argv[3] if len(sys.argv) > 3 else "/api/v1/queues"
DEPTH = int(sys.argv[4]) if len(sys.argv) > 4 else 16

stop = threading.Event()
lock = threading.Lock()
statuses = Counter()
TOKEN = os.environ.get("SLUICE_ADMIN_TOKEN")
AUTHORIZATION = f"Authorization: Bearer {TOKEN}\r\n" if TOKEN else ""
REQUEST = f"GET {PATH} HTTP/1.1\r\nHost: {HOST}:{PORT}\r\nAccept: application/json\r\n{AUTHORIZATION}\r\n".encode()


def answers(sock, buffer, n):
    """Reads n answers (status line, headers, a Content-Length body), counting each."""
    for _ in range(n):
        while True:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end >= 0:
                break
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buffer += chunk
        head = buffer[:head_end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        while len(buffer) < head_end + 4 + length:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buffer += chunk
        with lock:
            statuses[head[0].split(" ")[1]] += 1
        buffer = buffer[head_end + 4 + length:]
    return buffer


def flood():
    while not stop.is_set():
        try:
            with socket.create_connection((HOST, int(PORT)), timeout=30) as sock:
                buffer = b""
                while not stop.is_set():
                    sock.sendall(REQUEST * DEPTH)
                    buffer = answers(sock, buffer, DEPTH)
        except OSError:
            time.sleep(0.01)


signal.signal(signal.SIGTERM, lambda *_: stop.set())
signal.signal(signal.SIGINT, lambda *_: stop.set())
start = time.monotonic()
threads = [threading.Thread(target=flood, daemon=True) for _ in range(CONNECTIONS)]
for thread in threads:
    thread.start()
while not stop.is_set():
    stop.wait(0.1)
elapsed = time.monotonic() - start
with lock:
    total = sum(statuses.values())
    print(f"{total} {elapsed:.2f} {dict(statuses)}", flush=True)
