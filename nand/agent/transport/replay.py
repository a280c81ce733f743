"""Send the records of spool files to a server, for ``nand spool replay``.

The agent replays its rank's spool by itself when the server comes back, and
the next agent of the same run and rank adopts a dead agent's spool. This is
for the spools nobody will adopt (the job is over): each file is locked while
it is replayed (a live agent's file is skipped), every record is sent as it is
(same agent and seq, so the server drops what it already has), resent until
acknowledged or the time is up, and the file is deleted once all of it is
acknowledged.

>>> from pathlib import Path
>>> spool_files(Path("/nonexistent"))
[]
"""

from __future__ import annotations

import fcntl
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from nand import wire
from nand.agent.transport import connection
from nand.agent.transport.spool import read_records
from nand.errors import WireError


@dataclass
class ReplayResult:
    path: Path
    records: int = 0
    acked: int = 0
    skipped: str = ""  # why the file was not replayed, if it was not
    rejected: str = ""  # the server's reason, if it rejected us

    @property
    def complete(self) -> bool:
        return not self.skipped and not self.rejected and self.acked == self.records


def spool_files(path: Path) -> list[Path]:
    """The spool file itself, or every ``*.spool`` under a directory."""
    if path.is_dir():
        return sorted(path.rglob("*.spool"))
    return [path] if path.exists() else []


def replay_file(
    path: Path,
    endpoint: str,
    *,
    timeout: float = 30.0,
    ack_timeout: float = 2.0,
    window: int = 256,
    curve_server_key: str | None = None,
    keep: bool = False,
) -> ReplayResult:
    """Replay one spool file; delete it when every record was acknowledged."""
    result = ReplayResult(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            result.skipped = "a running agent owns it"
            return result
        frames = [(*_key(payload), payload) for _, payload in read_records(path)]
        result.records = len(frames)
        with _Connection(endpoint, curve_server_key) as conn:
            conn.run(frames, result, timeout, ack_timeout, window)
        if result.complete and not keep:
            path.unlink()
    finally:
        os.close(fd)
    return result


def _key(payload: bytes) -> tuple[str, int]:
    try:
        message = msgpack.unpackb(payload, raw=False)
        return str(message["agent"]), int(message["seq"])
    except Exception:
        return "?", -1


class _Connection:
    def __init__(self, endpoint: str, curve_server_key: str | None) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = connection.dealer(self.ctx, endpoint, curve_server_key=curve_server_key)
        self.sock.connect(endpoint)

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close(0)
        self.ctx.term()

    def run(
        self,
        frames: list[tuple[str, int, bytes]],
        result: ReplayResult,
        timeout: float,
        ack_timeout: float,
        window: int,
    ) -> None:
        """Windowed send; go back to the oldest unacknowledged record on a timeout."""
        deadline = time.monotonic() + timeout
        index = {(agent, seq): i for i, (agent, seq, _) in enumerate(frames)}
        inflight: OrderedDict[int, float] = OrderedDict()
        done: set[int] = set()
        nxt = 0
        while len(done) < len(frames) and time.monotonic() < deadline and not result.rejected:
            while nxt < len(frames) and len(inflight) < window:
                if inflight and frames[nxt][0] != frames[next(iter(inflight))][0]:
                    break  # one agent in flight at a time, so agent-less acks match
                if nxt not in done:
                    try:
                        self.sock.send(frames[nxt][2], zmq.NOBLOCK)
                    except zmq.Again:  # the connection's queue is full: read acks first
                        break
                    inflight[nxt] = time.monotonic() + ack_timeout
                nxt += 1
            self._read(frames, index, inflight, done, result)
            if inflight and next(iter(inflight.values())) < time.monotonic():
                nxt = min(inflight)  # resend from the oldest unacknowledged
                inflight.clear()
                ack_timeout = min(ack_timeout * 2, 30.0)
        result.acked = len(done)

    def _read(
        self,
        frames: list[tuple[str, int, bytes]],
        index: dict[tuple[str, int], int],
        inflight: OrderedDict[int, float],
        done: set[int],
        result: ReplayResult,
    ) -> None:
        if not self.sock.poll(50):
            return
        while True:
            try:
                message = wire.decode(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except WireError:
                continue
            if message["kind"] == "reject":
                result.rejected = message["reason"]
            elif message["kind"] == "ack":
                agent = message.get("agent")
                if not agent and inflight:
                    agent = frames[next(iter(inflight))][0]
                for seq in message["seqs"]:
                    i = index.get((agent, seq)) if agent else None
                    if i is not None:
                        done.add(i)
                        inflight.pop(i, None)
