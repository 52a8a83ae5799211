#!/usr/bin/env python3
"""Publish-to-webhook latency of a running sluice (issue 33 point 5), driven by
scripts/bench-latency.sh: a paced publisher and the webhook receiver in one process.

The publisher sends sluice envelopes to exchange `bench`, routing key `work`, at RATE msg/s
for SECONDS (pika, one connection, no confirms, in a thread of its own); each payload
carries the time it was sent. The receiver (asyncio, one thread, HTTP/1.1 keep-alive,
answers 200 at once) notes the time each one arrives. Latency = arrival - sending, on one
clock. The first second is left out (connections warming up). Prints the percentiles and
the maximum, and the ten worst with when they were sent.

    bench-latency.py AMQP_URL PORT RATE SECONDS
"""
import asyncio
import json
import sys
import threading
import time
import uuid

import pika


def publish(url, rate, seconds, done):
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    start = time.monotonic_ns()
    total = rate * seconds
    for i in range(total):
        due = start + i * 1_000_000_000 // rate
        while True:
            now = time.monotonic_ns()
            if now >= due:
                break
            time.sleep(min((due - now) / 1e9, 0.0005))
        body = json.dumps({
            "id": str(uuid.uuid4()), "type": "t", "version": 1,
            "payload": {"n": i, "sent": time.monotonic_ns()},
        })
        channel.basic_publish("bench", "work", body, pika.BasicProperties(delivery_mode=2))
    connection.close()
    done.set()


class Receiver(asyncio.Protocol):
    arrivals = []

    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""

    def data_received(self, data):
        now = time.monotonic_ns()
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1").lower()
            length = 0
            for line in head.split("\r\n"):
                if line.startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4:head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length:]
            payload = json.loads(body)
            payload = payload.get("payload", payload)
            Receiver.arrivals.append((payload["sent"], now))
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


async def main():
    url, port, rate, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Receiver, "127.0.0.1", port)
    print("ready", flush=True)
    # The runner is started once the receiver listens (the shell waits for "ready").
    await asyncio.sleep(2)
    done = threading.Event()
    threading.Thread(target=publish, args=(url, rate, seconds, done), daemon=True).start()
    total = rate * seconds
    deadline = time.monotonic() + seconds + 60
    while len(Receiver.arrivals) < total and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    server.close()
    arrivals = sorted(Receiver.arrivals)
    first = arrivals[0][0] if arrivals else 0
    steady = [(s, (a - s) / 1e6) for s, a in arrivals if s - first >= 1_000_000_000]
    ms = sorted(latency for _, latency in steady)
    if not ms:
        print("no messages arrived")
        return
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
    print(f"received {len(arrivals)} of {total} at {rate} msg/s; after the first second {len(ms)}")
    print(f"latency ms: p50 {pick(0.5):.2f}  p90 {pick(0.9):.2f}  p99 {pick(0.99):.2f}  "
          f"p99.9 {pick(0.999):.2f}  max {ms[-1]:.2f}  max/p99 {ms[-1] / pick(0.99):.2f}")
    worst = sorted(steady, key=lambda x: -x[1])[:10]
    print("worst (s after the first message, ms): " +
          ", ".join(f"{(s - first) / 1e9:.2f}: {lat:.1f}" for s, lat in worst))


asyncio.run(main())
