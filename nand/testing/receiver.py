"""A minimal real nand server side for tests: a ZeroMQ ROUTER on its own thread.

It decodes every frame with :func:`nand.wire.decode`, records each message
once per ``(agent, seq)`` in arrival order, acknowledges every frame it
accepted (duplicates too, so the agent can forget them) with
``{"kind": "ack", "agent": ..., "seqs": [...]}``, and counts what it rejects
by reason. It can send a command to an agent, stop and start again on the same
port, and be told not to answer (``answer=False``: frames are read and thrown
away, nothing is acknowledged), or to acknowledge late (``ack_delay_s``: as a
server that commits in batches, so an agent with steady traffic always has
something in flight).

>>> with Receiver() as rx:          # binds tcp://127.0.0.1:<free port>
...     endpoint = rx.endpoint      # give this to ServerSink / nand.watch(server=...)
...     rx.wait_for(lambda: True)
True
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from nand import wire
from nand.errors import WireError


class Receiver:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        *,
        answer: bool = True,
        token: str | None = None,
        curve_secret_key: bytes | None = None,
        ack_delay_s: float = 0.0,
    ) -> None:
        self.endpoint = endpoint
        self.answer = answer
        self.ack_delay_s = ack_delay_s
        self._late_acks: collections.deque[tuple[float, list[bytes]]] = collections.deque()
        self.token = token
        self.curve_secret_key = curve_secret_key
        self.lock = threading.Lock()
        #: Accepted messages per agent, each (agent, seq) once, in arrival order.
        self.messages: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        self.duplicates = 0
        self.ignored = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self._seen: set[tuple[str, int]] = set()
        self._routes: dict[str, bytes] = {}
        self._outbox: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ctx = zmq.Context()

    # --- lifecycle ------------------------------------------------------------

    def start(self) -> Receiver:
        """Bind (the same port again after :meth:`stop`) and serve on a thread."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.curve_secret_key is not None:
            sock.curve_server = True
            sock.curve_secretkey = self.curve_secret_key
        sock.bind(self.endpoint)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name="nand-test-receiver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the socket (the agents see the server go away); keep what was recorded."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._ctx.term()

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what tests use ---------------------------------------------------------

    def send_command(self, agent: str, command: dict[str, Any]) -> None:
        """Queue ``{"kind": "command", **command}`` for an agent it has heard from."""
        with self.lock:
            self._outbox.append((agent, {"kind": "command", **command}))

    def all(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            out = [m for msgs in self.messages.values() for m in msgs]
        return [m for m in out if kind is None or m["kind"] == kind]

    def count(self, kind: str | None = None) -> int:
        return len(self.all(kind))

    def seqs(self, agent: str) -> list[int]:
        with self.lock:
            return [m["seq"] for m in self.messages.get(agent, [])]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    # --- the thread ---------------------------------------------------------------

    def _serve(self, sock: zmq.Socket[Any]) -> None:
        try:
            while not self._stop.is_set():
                acks: dict[tuple[bytes, str], list[int]] = collections.defaultdict(list)
                if sock.poll(20):
                    while True:
                        try:
                            route, frame = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except ValueError:
                            continue  # not [route, frame]
                        self._accept(sock, route, frame, acks)
                due = time.monotonic() + self.ack_delay_s
                for (route, agent), seqs in acks.items():
                    ack = wire.encode({"kind": "ack", "agent": agent, "seqs": seqs})
                    self._late_acks.append((due, [route, ack]))
                while self._late_acks and self._late_acks[0][0] <= time.monotonic():
                    sock.send_multipart(self._late_acks.popleft()[1])
                self._flush_outbox(sock)
        finally:
            sock.close(0)

    def _accept(
        self, sock: zmq.Socket[Any], route: bytes, frame: bytes, acks: dict[Any, list[int]]
    ) -> None:
        if not self.answer:
            self.ignored += 1
            return
        try:
            message = wire.decode(frame)
        except WireError as exc:
            self.rejected[exc.reason] += 1
            return
        if message["kind"] not in wire.AGENT_KINDS:
            self.rejected["unknown_kind"] += 1
            return
        agent, seq = message["agent"], message["seq"]
        if message["kind"] == "hello" and self.token and message["body"].get("token") != self.token:
            self.rejected["unauthenticated"] += 1
            sock.send_multipart([route, wire.encode({"kind": "reject", "reason": "bad token"})])
            return
        with self.lock:
            self._routes[agent] = route
            if (agent, seq) in self._seen:
                self.duplicates += 1
            else:
                self._seen.add((agent, seq))
                self.messages[agent].append(message)
        acks[(route, agent)].append(seq)

    def _flush_outbox(self, sock: zmq.Socket[Any]) -> None:
        with self.lock:
            pending = [(self._routes.get(a), m) for a, m in self._outbox]
            self._outbox.clear()
        for route, message in pending:
            if route is not None:
                sock.send_multipart([route, wire.encode(message)])
