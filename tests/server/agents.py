"""A fake agent for tests: a real ZeroMQ DEALER sending wire-encoded messages."""

from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

from nand import wire
from nand.events import Event, FlightWindow, StepSummary


class FakeAgent:
    def __init__(
        self,
        endpoint: str,
        *,
        run: str = "run-1",
        rank: int = 0,
        world_size: int = 1,
        agent: str | None = None,
        curve: tuple[str, str, str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.run, self.rank, self.world_size = run, rank, world_size
        self.agent = agent or uuid.uuid4().hex
        self.seq = 0
        self.context = zmq.Context.instance()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A send with no peer to queue for fails in 30 s instead of hanging the test.
        self.sock.setsockopt(zmq.SNDTIMEO, 30_000)
        if curve is not None:
            server_public, public, secret = curve
            self.sock.curve_serverkey = server_public.encode()
            self.sock.curve_publickey = public.encode()
            self.sock.curve_secretkey = secret.encode()
        self.sock.connect(endpoint)
        self.acked: set[int] = set()
        self.commands: list[dict[str, Any]] = []
        self.rejects: list[dict[str, Any]] = []

    def close(self) -> None:
        self.sock.close(linger=0)

    def reconnected(self) -> FakeAgent:
        """This agent on a new connection (a new routing id), as after a
        reconnect: same agent id, its seqs going on, no second hello."""
        self.close()
        again = FakeAgent(self.endpoint, run=self.run, rank=self.rank, agent=self.agent)
        again.seq = self.seq
        return again

    def message(self, kind: str, body: dict[str, Any], seq: int | None = None) -> dict[str, Any]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return wire.agent_message(
            kind, agent=self.agent, seq=seq, run=self.run, rank=self.rank, body=body
        )

    def send(self, kind: str, body: dict[str, Any], seq: int | None = None) -> int:
        message = self.message(kind, body, seq)
        self.sock.send(wire.encode(message))
        return int(message["seq"])

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def hello(self, token: str | None = None, **extra: Any) -> int:
        return self.send("hello", self.hello_body(token, **extra))

    def hello_body(self, token: str | None = None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "world_size": self.world_size,
            "host": f"host-{self.rank}",
            "pid": 1000 + self.rank,
            "modules": [{"name": "fc1", "type": "Linear"}, {"name": "fc2", "type": "Linear"}],
            "optimizer": "AdamW",
            "versions": {"torch": "2.13"},
            **extra,
        }
        if token is not None:
            body["token"] = token
        return body

    def heartbeat(self, step: int, dropped: Any = None, **fields: Any) -> int:
        """``dropped``: the agent's cumulative losses by reason, as the transport sends them."""
        body = StepSummary(step=step, **fields).to_dict()
        if dropped is not None:
            body["dropped"] = dropped
        return self.send("heartbeat", body)

    def event(self, flight: FlightWindow | None = None, **fields: Any) -> int:
        event = Event(run=self.run, rank=self.rank, world_size=self.world_size, **fields)
        body = {"event": event.to_dict(), "flight": flight.to_dict() if flight else None}
        return self.send("event", body)

    def flight(self, window: FlightWindow, reason: str = "requested") -> int:
        return self.send("flight", {"flight": window.to_dict(), "reason": reason})

    def bye(self, step: int, reason: str = "done") -> int:
        return self.send("bye", {"step": step, "reason": reason})

    def pump(self, timeout: float = 0.05) -> list[dict[str, Any]]:
        """Receive whatever the server sent within ``timeout`` seconds."""
        got = []
        deadline = time.monotonic() + timeout
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(left):
                return got
            reply = wire.decode(self.sock.recv())
            got.append(reply)
            if reply["kind"] == "ack":
                self.acked.update(reply["seqs"])
            elif reply["kind"] == "command":
                self.commands.append(reply)
            elif reply["kind"] == "reject":
                self.rejects.append(reply)

    def wait_acked(self, seqs: set[int] | None = None, timeout: float = 10.0) -> None:
        wanted = set(range(1, self.seq + 1)) if seqs is None else seqs
        deadline = time.monotonic() + timeout
        while not wanted <= self.acked:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not acked: {sorted(wanted - self.acked)}")
            self.pump(0.1)

    def send_until_acked(self, kind: str, body: dict[str, Any], timeout: float = 10.0) -> int:
        """Send one message and resend it until acked, as a real agent does after its
        ack timeout (a connection that takes over an agent id may be refused until
        the server has seen the old one go); its seq."""
        seq = self.seq + 1
        deadline = time.monotonic() + timeout
        while seq not in self.acked:
            if time.monotonic() > deadline:
                raise TimeoutError(f"seq {seq} never acked")
            self.send(kind, body, seq=seq)
            self.pump(0.3)
        self.seq = seq
        return seq

    def wait_for(self, what: str, timeout: float = 10.0) -> dict[str, Any]:
        """Wait for the next ``reject``, or the next command named ``what`` (``stop``...)."""
        deadline = time.monotonic() + timeout
        while True:
            store = self.rejects if what == "reject" else self.commands
            for i, item in enumerate(store):
                if what == "reject" or item.get("command") == what:
                    return store.pop(i)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} received")
            self.pump(0.1)
