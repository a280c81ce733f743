"""A real HTTP receiver for notification tests: records every POST to a JSONL file.

    python tests/server/webhook.py --port 8765 --out requests.jsonl [--delay 3] [--status 200]

Each line: ``{"path", "headers", "body" (the raw body as text), "received",
"answered"}`` (Unix seconds), written after the answer went out, so a line
means "delivered". ``--delay`` sleeps before answering (a slow receiver);
``--status`` answers with that code. Prints ``listening <port>`` when ready.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handler(out: str, delay: float, status: int) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received = time.time()
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(delay)
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            self.wfile.flush()
            record = {
                "path": self.path,
                "headers": dict(self.headers.items()),
                "body": body.decode(),
                "received": received,
                "answered": time.time(),
            }
            with lock, open(out, "a") as file:
                file.write(json.dumps(record) + "\n")

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--status", type=int, default=200)
    args = parser.parse_args()
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.port), handler(args.out, args.delay, args.status)
    )
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
