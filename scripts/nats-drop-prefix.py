#!/usr/bin/env python3
"""Deletes the JetStream streams of one sluice deployment (a `?prefix=`) on a NATS server: its
queues' streams PREFIX_q_HEX and its buckets' streams KV_PREFIX_topology and KV_PREFIX_consumers.
The bench scripts clean up with it; it speaks the NATS protocol itself (no `nats` CLI needed).

    scripts/nats-drop-prefix.py PREFIX [HOST:PORT]     # default 127.0.0.1:4222

PREFIX ending in `*` names every deployment whose prefix starts with the rest. Prints how many streams it deleted; exits 1 when the server refuses a deletion.
"""
import json
import socket
import sys

INBOX = "_INBOX.sluice_drop_prefix"


class Nats:
    def __init__(self, address):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buf = b""
        self.line()  # INFO
        self.send(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true}\r\n')
        self.send(f"SUB {INBOX} 1\r\n".encode())

    def send(self, data):
        self.sock.sendall(data)

    def read(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line.decode()

    def request(self, subject, payload=b""):
        """The JSON answer to one JetStream API request."""
        self.send(f"PUB {subject} {INBOX} {len(payload)}\r\n".encode() + payload + b"\r\n")
        while True:
            line = self.line()
            op = line.split(" ", 1)[0].upper()
            if op == "PING":
                self.send(b"PONG\r\n")
            elif op == "-ERR":
                raise RuntimeError(line)
            elif op == "MSG":
                return json.loads(self.read(int(line.split()[-1]) + 2)[:-2])
            elif op == "HMSG":  # a status only (no responders: JetStream is off)
                self.read(int(line.split()[-1]) + 2)
                raise RuntimeError(f"no answer to {subject}: is JetStream enabled?")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    prefix = sys.argv[1]
    nats = Nats(sys.argv[2] if len(sys.argv) == 3 else "127.0.0.1:4222")
    names, offset = [], 0
    while True:
        page = nats.request("$JS.API.STREAM.NAMES", json.dumps({"offset": offset}).encode())
        streams = page.get("streams") or []
        names += streams
        offset += len(streams)
        if not streams or offset >= page.get("total", 0):
            break
    if prefix.endswith("*"):
        ours = [n for n in names if n.removeprefix("KV_").startswith(prefix[:-1])]
    else:
        ours = [n for n in names if n.startswith(f"{prefix}_q_") or n in (f"KV_{prefix}_topology", f"KV_{prefix}_consumers")]
    for name in ours:
        answer = nats.request(f"$JS.API.STREAM.DELETE.{name}")
        if not answer.get("success"):
            sys.exit(f"deleting stream {name}: {answer.get('error')}")
    print(len(ours))


if __name__ == "__main__":
    main()
