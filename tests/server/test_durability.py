"""Crash safety and statelessness with real server processes."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from nand.server.storage.models import EventRow, Message
from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually
from tests.server.processes import ServerProcess

pytestmark = pytest.mark.slow

N = 3000


def _event_body(step: int) -> dict:
    return {
        "event": {
            "step": step,
            "micro_step": 0,
            "phase": "forward",
            "module": "fc",
            "order": 0,
            "cause": "produced",
            "nan": 1,
        },
        "flight": None,
    }


def test_kill_9_then_restart_loses_nothing_that_was_acked(db_url) -> None:
    port = free_port()
    first = ServerProcess(db_url, port).start()
    agent = FakeAgent(first.zmq_endpoint, run="crash")
    try:
        for step in range(N):
            agent.send("event", _event_body(step))
        eventually(lambda: len(agent.pump(0.05)) >= 0 and len(agent.acked) >= 200, timeout=30)
        first.kill9()
        acked_before_kill = set(agent.acked)
        agent.pump(0.2)  # acks still in the socket's queue were sent before the kill
        acked_before_kill |= agent.acked
        assert len(acked_before_kill) > 0
        print("acked before the kill:", len(acked_before_kill), "of", N)
        engine = create_engine(db_url)
        with engine.connect() as conn:
            stored = set(conn.scalars(select(Message.seq).where(Message.agent == agent.agent)))
        assert acked_before_kill <= stored, "an acknowledged message was lost"

        second = ServerProcess(db_url, port).start()
        try:
            # The agent resends what was not acked (it keeps its queue until acked).
            for seq in sorted(set(range(1, N + 1)) - agent.acked):
                agent.send("event", _event_body(seq - 1), seq=seq)
            agent.wait_acked(set(range(1, N + 1)), timeout=60)
            with engine.connect() as conn:
                assert conn.scalar(select(func.count()).select_from(EventRow)) == N
            verdict = httpx.get(f"{second.http_url}/api/runs/crash/verdict").json()
            assert verdict["origin"]["step"] == 0
        finally:
            second.stop()
        engine.dispose()
    finally:
        agent.close()
        first.stop()


@pytest.mark.postgres
def test_two_servers_on_one_postgres_give_the_same_answers(postgres) -> None:
    with postgres.database() as db_url:
        a = ServerProcess(db_url, free_port(), NAND_TOKEN="tok").start()
        b = ServerProcess(db_url, free_port(), NAND_TOKEN="tok").start()
        ranks = [
            FakeAgent((a if r % 2 == 0 else b).zmq_endpoint, run="shared", rank=r, world_size=4)
            for r in range(4)
        ]
        try:
            for agent in ranks:
                agent.hello(token="tok")
                agent.heartbeat(20, steps_per_s=1.0)
            ranks[3].event(step=21, phase="backward", module="fc2", module_type="Linear", nan=2)
            for agent in ranks[:3]:
                agent.event(step=21, phase="grad", module="fc2.weight", nan=2)
            for agent in ranks:
                agent.wait_acked()
            for path in (
                "/api/runs/shared/verdict",
                "/api/runs/shared/ranks",
                "/api/runs/shared/events",
                "/api/runs",
            ):
                answers = [httpx.get(f"{s.http_url}{path}").json() for s in (a, b)]
                assert answers[0] == answers[1], path
            verdict = httpx.get(f"{a.http_url}/api/runs/shared/verdict").json()
            assert verdict["origin"]["rank"] == 3 and verdict["ranks_received"] == [0, 1, 2]
            # A stop asked on one server reaches the agents connected to the other.
            stop = httpx.post(
                f"{a.http_url}/api/runs/shared/stop", headers={"Authorization": "Bearer tok"}
            ).json()
            started = time.monotonic()
            for agent in ranks:
                assert agent.wait_for("stop", timeout=10)["step"] == stop["step"]
            assert time.monotonic() - started < 10
        finally:
            for agent in ranks:
                agent.close()
            a.stop()
            b.stop()


def test_another_process_reading_the_sqlite_file_sees_every_write(sqlite_url, tmp_path) -> None:
    """The server keeps SQLite's locks on its database: a process that opens
    the file (``sqlite3``, a second server, a backup) and closes it again
    neither deletes the WAL under the server's feet nor reads a stale file."""
    import contextlib
    import sqlite3

    path = tmp_path / "nand.db"

    def beats_seen_elsewhere() -> int:
        with contextlib.closing(sqlite3.connect(path)) as other:
            return other.execute("SELECT count(*) FROM heartbeats").fetchone()[0]

    server = ServerProcess(sqlite_url, free_port()).start()
    agent = FakeAgent(server.zmq_endpoint, run="locks")
    try:
        agent.hello()
        agent.heartbeat(1)
        agent.wait_acked()
        assert beats_seen_elsewhere() == 1
        assert (tmp_path / "nand.db-wal").exists()  # still the server's
        agent.heartbeat(2)
        agent.wait_acked()
        assert beats_seen_elsewhere() == 2
    finally:
        agent.close()
        server.stop()
