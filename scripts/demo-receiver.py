#!/usr/bin/env python3
"""A stand-in for the charge and email services of pipelines/orders.yaml: answers 200 to every
request on 127.0.0.1:8088 and prints what arrived. Used by scripts/demo."""
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _answer(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length).decode("utf-8", "replace")
        key = self.headers.get("idempotency-key")
        attempt = self.headers.get("x-sluice-attempt")
        print(f"receiver: {self.command} {self.path} key={key} attempt={attempt} body={body}", flush=True)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    do_POST = do_PUT = do_GET = _answer

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", 8088), Handler).serve_forever()
