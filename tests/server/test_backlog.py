"""Events pass the heartbeats queued before them (nand.server.agents.backlog):
a real ``nand server`` process, one raw DEALER socket speaking for thousands of
ranks as ``benchmarks/loadgen.py`` does, and the verdict and ``/metrics`` read
over HTTP while the heartbeats are still being stored."""

from __future__ import annotations

import re
import sqlite3
import time

import httpx
import pytest
import zmq

from benchmarks import loadgen
from nand import wire
from nand.server.agents.backlog import Backlog
from nand.testing import free_port
from tests.server.helpers import eventually
from tests.server.processes import ServerProcess

RANKS = 2_000
BEATS_PER_RANK = 8
PLAN = loadgen.Plan(run="queued", world=RANKS, servers=(), seconds=0)


def _stored(server: ServerProcess, kind: str) -> int:
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    match = re.search(rf'^nand_messages_stored_total{{kind="{kind}"}} (\S+)$', text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


def _frame(kind: str, agent: str, rank: int, seq: int, body: dict) -> bytes:
    who = {"agent": agent, "seq": seq, "run": PLAN.run, "rank": rank}
    return wire.encode(wire.agent_message(kind, **who, body=body))


def _hello(rank: int, launch: str) -> dict:
    """A hello of ``launch`` (``NAND_LAUNCH``: a new one starts a new attempt)."""
    return {**loadgen.hello(PLAN, rank), "launch": launch}


def _origin(server: ServerProcess, attempt: int | None = None) -> dict | None:
    query = f"?attempt={attempt}" if attempt else ""
    url = f"{server.http_url}/api/runs/{PLAN.run}/verdict{query}"
    response = httpx.get(url, timeout=30)
    return response.json().get("origin") if response.status_code == 200 else None


@pytest.fixture
def server(tmp_path):
    process = ServerProcess(f"sqlite:///{tmp_path}/nand.db", free_port()).start()
    yield process
    process.stop()


@pytest.fixture
def dealer(server):
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)  # every ack is kept (they are not read)
    sock.connect(server.zmq_endpoint)
    yield sock
    sock.close(linger=0)
    context.term()


@pytest.mark.slow
def test_an_event_sent_behind_thousands_of_heartbeats_is_in_the_verdict_before_they_are_stored(
    server, dealer, tmp_path
) -> None:
    for rank in range(RANKS):
        dealer.send(_frame("hello", f"a{rank}", rank, 1, _hello(rank, "first")))
    eventually(lambda: _stored(server, "hello") == RANKS, timeout=120, interval=0.2)
    # Every rank's heartbeats; then rank 7's process restarted by a new launch (a
    # new attempt of the run): its hello and its NaN, all on one connection,
    # framed first so that they leave at once.
    beat = {"step": 1, "loss": 2.0, "grad_norm": 1.0}
    beats = [
        _frame("heartbeat", f"a{rank}", rank, 1 + n, {**beat, "step": n})
        for n in range(1, BEATS_PER_RANK + 1)
        for rank in range(RANKS)
    ]
    restarted = [_frame("hello", "b7", 7, 1, _hello(7, "second"))]
    restarted.append(_frame("event", "b7", 7, 2, loadgen.nan_event(PLAN, 7, 5, produced=True)))
    for frame in [*beats, *restarted]:
        dealer.send(frame)
    origin = eventually(lambda: _origin(server), timeout=120, interval=0.02)
    heartbeats_then = _stored(server, "heartbeat")

    assert origin["rank"] == 7
    assert heartbeats_then < len(beats), "the event waited for every heartbeat sent before it"
    print(f"heartbeats stored when the verdict named the event: {heartbeats_then} of {len(beats)}")
    # The hello went with the event (it decides the attempt: the second, the live
    # one); nothing lost or stored twice.
    assert _origin(server, attempt=1) is None
    eventually(lambda: _stored(server, "heartbeat") == len(beats), timeout=120, interval=0.2)
    time.sleep(0.5)
    db = sqlite3.connect(tmp_path / "nand.db")
    assert db.execute("select count(*) from heartbeats").fetchone() == (len(beats),)
    assert db.execute(
        "select attempt from runs join events on events.run_id = runs.id"
    ).fetchall() == [(2,)]
    db.close()


def _entry(kind: str, agent: str, seq: int) -> tuple[bytes, dict]:
    return (b"connection", {"kind": kind, "agent": agent, "seq": seq})


def test_a_batch_cut_short_keeps_every_agents_messages_in_the_order_they_came() -> None:
    queue = Backlog(max_messages=100, max_bytes=10_000)
    came = [_entry("heartbeat", agent, seq) for seq in (1, 2, 3) for agent in "abc"]
    came += [_entry("event", "a", 4), _entry("bye", "b", 4), _entry("heartbeat", "c", 4)]
    queue.add(came, size=1_200)

    batches = [[(m["agent"], m["seq"]) for _, m in queue.take(limit)] for limit in (5, 100, 100)]

    # The event's and the bye's agents first (cut at 5), then what remains of
    # them, then the agent that sent only heartbeats.
    assert batches[0] == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]
    assert batches[1] == [("b", 3), ("a", 4), ("b", 4)]
    assert batches[2] == [("c", 1), ("c", 2), ("c", 3), ("c", 4)]
    assert len(queue) == 0 and queue.room() == (100, 10_000)


def test_without_an_event_queued_the_oldest_messages_go_first() -> None:
    queue = Backlog(max_messages=4, max_bytes=10_000)
    queue.add([_entry("hello", "a", 1), _entry("heartbeat", "b", 1)], size=200)
    queue.add([_entry("heartbeat", "a", 2), _entry("fingerprint", "b", 2)], size=200)

    assert queue.room() == (0, 9_600)
    assert [(m["agent"], m["seq"]) for _, m in queue.take(3)] == [("a", 1), ("b", 1), ("a", 2)]
    queue.clear()
    assert len(queue) == 0 and queue.room() == (4, 10_000)
