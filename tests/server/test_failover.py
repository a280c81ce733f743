"""Any server of several may die: kill -9 one of three servers on one PostgreSQL
while real agent processes and simulated ranks report, and nothing is lost,
nothing stored twice, the verdict stays right and ``nand wait`` does not notice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, func, select

from nand.events import StepSummary
from nand.testing import free_port
from tests.server import failover_agent as real
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually
from tests.server.processes import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

RUN = "failover"
REAL_RANKS = 4
SIMULATED_RANKS = 8
WORLD = REAL_RANKS + SIMULATED_RANKS
SIM_STEPS = 20
ROOT = Path(__file__).resolve().parents[2]


class SimulatedRank:
    """A rank speaking the wire by hand (``FakeAgent``), keeping what it sent so
    that it can resend all of it, acknowledged or not, to another server."""

    def __init__(self, endpoint: str, rank: int) -> None:
        self.rank = rank
        self.fake = FakeAgent(endpoint, run=RUN, rank=rank, world_size=WORLD)
        self.sent: list[tuple[str, dict[str, Any], int]] = []

    def send(self, kind: str, body: dict[str, Any]) -> None:
        self.sent.append((kind, body, self.fake.send(kind, body)))

    def report_steps(self) -> None:
        hello = {"world_size": WORLD, "host": "sim", "pid": self.rank, "token": real.TOKEN}
        self.send("hello", hello)
        for step in range(1, SIM_STEPS + 1):
            self.send("heartbeat", StepSummary(step=step, loss=1.0).to_dict())

    def report_received(self) -> None:
        event = real.event_of(RUN, self.rank, WORLD)
        self.send("event", {"event": event.to_dict(), "flight": None})
        self.send("bye", {"step": SIM_STEPS, "reason": "done"})

    def wait_acked(self, timeout: float) -> None:
        """Resend what is not acknowledged every second, as a real agent does after
        its ack timeout: a server refuses a moved agent's id until the dead server's
        lease on it runs out (nand.server.agents.leases)."""
        deadline = time.monotonic() + timeout
        while not {seq for *_, seq in self.sent} <= self.fake.acked:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: not all acknowledged")
            self.fake.pump(1.0)
            for kind, body, seq in self.sent:
                if seq not in self.fake.acked:
                    self.fake.send(kind, body, seq=seq)

    def move_to(self, endpoint: str) -> None:
        """Its server died: everything again, to another (same agent id, same seqs)."""
        self.fake.close()
        agent = self.fake.agent
        moved = FakeAgent(endpoint, run=RUN, rank=self.rank, world_size=WORLD, agent=agent)
        moved.seq = self.fake.seq
        for kind, body, seq in self.sent:
            moved.send(kind, body, seq=seq)
        self.fake = moved


def _start_servers(db_url: str) -> list[ServerProcess]:
    servers = [ServerProcess(db_url, free_port(), NAND_TOKEN=real.TOKEN) for _ in range(3)]
    threads = [threading.Thread(target=s.start, kwargs={"timeout": 60}) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(s.http_url for s in servers), "a server did not start"
    return servers


def _start_agents(servers: list[ServerProcess], go_file: Path) -> list[subprocess.Popen[str]]:
    endpoints = ",".join(s.zmq_endpoint for s in servers)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    module = "tests.server.failover_agent"
    return [
        subprocess.Popen(
            [sys.executable, "-m", module, RUN, str(r), str(WORLD), endpoints, str(go_file)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(REAL_RANKS)
    ]


def _nand_wait(urls: str, until: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "nand", "wait", RUN, "--until", until, "--url", urls]
    return subprocess.Popen(
        [*command, "--timeout", "90", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _heartbeat_steps(engine: Engine) -> dict[int, int]:
    """Per rank, the highest step stored."""
    from nand.server.storage.models import Heartbeat

    with engine.connect() as conn:
        highest = select(Heartbeat.rank, func.max(Heartbeat.step)).group_by(Heartbeat.rank)
        rows = conn.execute(highest)
        return {int(rank): int(step) for rank, step in rows}


def _stored_exactly_once(engine: Engine, sent: dict[str, int]) -> None:
    """Each agent's seqs 1..n stored once (no gap), and the rows they made once each."""
    from nand.server.storage.models import EventRow, Heartbeat, Message

    with engine.connect() as conn:
        for agent, count in sent.items():
            seqs = sorted(conn.scalars(select(Message.seq).where(Message.agent == agent)))
            assert seqs == list(range(1, count + 1)), f"agent {agent}: {len(seqs)} of {count}"
        per_rank = select(EventRow.rank, func.count()).group_by(EventRow.rank)
        events = {int(rank): int(n) for rank, n in conn.execute(per_rank)}
        beats = conn.execute(
            select(Heartbeat.rank, func.count(), func.count(Heartbeat.step.distinct())).group_by(
                Heartbeat.rank
            )
        )
        beats_by_rank = {int(rank): (int(n), int(distinct)) for rank, n, distinct in beats}
    assert events == dict.fromkeys(range(WORLD), 1), events
    for rank in range(WORLD):
        steps = real.STEPS if rank < REAL_RANKS else SIM_STEPS
        assert beats_by_rank[rank] == (steps, steps), (rank, beats_by_rank[rank])


def test_kill_9_of_one_of_three_servers_moves_its_agents_and_loses_nothing(
    postgres, tmp_path
) -> None:
    with postgres.database() as db_url:
        engine = create_engine(db_url)
        servers = _start_servers(db_url)
        doomed, alive = servers[0], servers[1:]
        go_file = tmp_path / "killed"
        agents: list[subprocess.Popen[str]] = []
        sims = [SimulatedRank(servers[r % 3].zmq_endpoint, r) for r in range(REAL_RANKS, WORLD)]
        try:
            agents = _start_agents(servers, go_file)
            for sim in sims:
                sim.report_steps()
            for sim in sims:
                sim.fake.wait_acked(timeout=30)
            # Started before the kill, following the doomed server first.
            watchdog = _nand_wait(f"{doomed.http_url},{alive[0].http_url}", "diverged")
            # Kill while every real agent is mid-run (ranks 0 and 3 report to servers[0]).
            eventually(lambda: all(_heartbeat_steps(engine).get(r, 0) >= 20 for r in range(4)), 30)
            doomed.kill9()
            go_file.write_text("")
            for sim in sims:
                if sim.fake.endpoint == doomed.zmq_endpoint:
                    sim.move_to(alive[0].zmq_endpoint)
                sim.report_received()
            for sim in sims:
                sim.wait_acked(timeout=60)
            outputs = [json.loads(agent.communicate(timeout=90)[0]) for agent in agents]

            for out in outputs:
                assert out["flushed"] and out["dropped"] == {}, out
            moved = {out["rank"] for out in outputs if out.get("failovers")}
            assert moved == {0, 3}, outputs  # the doomed server's agents, and only they
            sent = {out["agent"]: out["submitted"] for out in outputs}
            sent.update({sim.fake.agent: sim.fake.seq for sim in sims})
            _stored_exactly_once(engine, sent)

            verdict = httpx.get(f"{alive[1].http_url}/api/runs/{RUN}/verdict").json()
            assert verdict["origin"]["rank"] == real.ORIGIN_RANK, verdict
            assert verdict["origin"]["step"] == real.EVENT_STEP, verdict
            assert verdict["ranks_received"] == [r for r in range(WORLD) if r != real.ORIGIN_RANK]

            out, err = watchdog.communicate(timeout=60)
            assert watchdog.returncode == 0 and "diverged" in out, (out, err)
            assert "lost the server" not in err, err
            # Asked after the kill, the dead server first in the list.
            late = _nand_wait(f"{doomed.http_url} {alive[1].http_url}", "any")
            out, err = late.communicate(timeout=60)
            assert late.returncode == 3 and "lost the server" not in err, (out, err)
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
            for sim in sims:
                sim.fake.close()
            for server in servers:
                server.stop()
            engine.dispose()
