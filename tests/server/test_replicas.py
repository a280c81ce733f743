"""The DDP replicas compared by a real ``nand server`` process: fingerprints
sent over ZeroMQ, the verdict and the runs list read over REST (issue 18)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import select

from nand import exitcodes, wire
from nand.server.agents.writer import write_batch
from nand.server.storage.db import make_engine
from nand.server.storage.migrate import upgrade
from nand.server.storage.models import Run
from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.processes import ServerProcess

NAMES = ["embed.weight", "head.weight", "head.bias"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    db = tmp_path_factory.mktemp("replicas") / "r.db"
    process = ServerProcess(f"sqlite:///{db}", free_port()).start()
    yield process
    process.stop()


def ranks(server: ServerProcess, run: str, world: int) -> list[FakeAgent]:
    agents = [
        FakeAgent(server.zmq_endpoint, run=run, rank=r, world_size=world) for r in range(world)
    ]
    for agent in agents:
        agent.hello()
    return agents


def send(agents: list[FakeAgent], step: int, values: dict[int, list[int]]) -> None:
    for agent in agents:
        body = {"step": step, "names": NAMES, "values": values.get(agent.rank, [11, 22, 33])}
        agent.send("fingerprint", body)
    for agent in agents:
        agent.wait_acked()


def verdict(server: ServerProcess, run: str) -> dict:
    return httpx.get(f"{server.http_url}/api/runs/{run}/verdict").json()


def test_a_rank_that_differs_from_the_majority_is_named_with_the_bracketing_steps(server):
    agents = ranks(server, "drifted", 4)
    send(agents, 0, {})
    send(agents, 100, {})
    send(agents, 200, {2: [11, 23, 33]})  # rank 2's head.weight differs
    send(agents, 300, {2: [11, 24, 34]})
    found = verdict(server, "drifted")
    assert found["state"] == "replica_mismatch"
    assert found["replica"] == {
        "state": "mismatch",
        "ranks": [2],
        "first_bad_step": 200,
        "last_good_step": 100,
        "params": ["head.weight"],
        "summary": found["summary"],
    }
    bracket = "between steps 100 and 200, in head.weight."
    assert f"rank 2's parameters differ from the other replicas' {bracket}" in found["summary"]
    assert "restart from a checkpoint taken at or before step 100." in found["summary"]
    runs = httpx.get(f"{server.http_url}/api/runs").json()
    assert next(r for r in runs if r["run"] == "drifted")["state"] == "replica_mismatch"
    metrics = httpx.get(f"{server.http_url}/metrics").text
    assert 'nand_runs{state="replica_mismatch"} 1.0' in metrics


def test_agreeing_replicas_are_consistent_and_a_step_counts_once_all_reported(server):
    agents = ranks(server, "agreeing", 3)
    for step in range(0, 1000, 100):
        send(agents, step, {})
    send(agents[:2], 1000, {})  # rank 2 has not reported step 1000 yet
    found = verdict(server, "agreeing")
    assert found["state"] != "replica_mismatch"
    assert found["replica"]["state"] == "consistent"
    assert found["replica"]["last_good_step"] == 900


def test_two_replicas_that_differ_are_both_named(server):
    agents = ranks(server, "pair", 2)
    send(agents, 0, {})
    send(agents, 10, {1: [11, 22, 34]})
    replica = verdict(server, "pair")["replica"]
    assert replica["ranks"] == [0, 1] and replica["params"] == ["head.bias"]
    assert replica["last_good_step"] == 0 and replica["first_bad_step"] == 10
    assert "ranks 0, 1 hold different parameters" in replica["summary"]
    assert "between steps 0 and 10, in head.bias." in replica["summary"]


def test_ranks_that_ended_at_different_steps_are_not_compared_with_each_other(server):
    """Each rank's last fingerprint is of the state after its own last step:
    rank 2 ended (crashed) at step 5, the others at 8. Different steps hold
    different weights; only fingerprints of one step are compared."""
    agents = ranks(server, "ended-apart", 3)
    send(agents, 0, {})
    send(agents[2:], 5, {2: [11, 55, 33]})
    send(agents[:2], 8, {0: [11, 88, 33], 1: [11, 88, 33]})
    found = verdict(server, "ended-apart")
    assert found["state"] != "replica_mismatch", found["summary"]
    assert found["replica"] == {
        "state": "consistent",
        "ranks": [],
        "first_bad_step": None,
        "last_good_step": 0,
        "params": [],
        "summary": "",
    }


def test_a_malformed_fingerprint_is_rejected_and_counted(server):
    (agent,) = ranks(server, "malformed", 1)
    before = rejected(server)
    agent.send("fingerprint", {"step": 1, "names": ["a"], "values": [1, 2]})
    agent.send("fingerprint", {"step": 1, "names": ["a"], "values": [2**63 + 5]})
    deadline = time.monotonic() + 5
    while rejected(server) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rejected(server) == before + 2
    assert verdict(server, "malformed")["replica"] is None  # nothing stored


def rejected(server: ServerProcess) -> float:
    metrics = httpx.get(f"{server.http_url}/metrics").text
    line = next(x for x in metrics.splitlines() if 'reason="bad_field"' in x and "rejected" in x)
    return float(line.split()[-1])


def test_nand_wait_until_mismatch_and_its_exit_code(server):
    agents = ranks(server, "waited-mismatch", 3)
    send(agents, 0, {})
    send(agents, 50, {0: [12, 22, 33]})
    wait = [sys.executable, "-m", "nand", "wait", "waited-mismatch", "--url", server.http_url]
    until = {
        until: subprocess.run([*wait, "--until", until, "--timeout", "30"], timeout=60).returncode
        for until in ("mismatch", "finished")
    }
    assert until == {"mismatch": 0, "finished": exitcodes.REPLICA_MISMATCH}


def test_ranks_whose_hellos_share_the_batch_are_not_taken_for_the_whole_job(tmp_path):
    """Three of four ranks agree in the batch that also carries the hellos:
    the job has four ranks, so that step is not yet "every replica agreed".
    (Before the fix the run's world size was still 0 when the batch's
    fingerprints were compared: the dashboard then read "between steps 400
    and 300".)"""
    engine = make_engine(f"sqlite:///{tmp_path / 'r.db'}")
    upgrade(engine)
    agents = [
        FakeAgent("tcp://127.0.0.1:1", run="one-batch", rank=r, world_size=4) for r in range(4)
    ]
    hellos = [
        a.message("hello", {"world_size": 4, "host": f"h{a.rank}", "pid": a.rank}) for a in agents
    ]
    agreeing = [fingerprint(a, 400, [11, 22, 33]) for a in agents[:3]]
    write_batch(engine, decoded(hellos + agreeing), time.time())
    assert replica_columns(engine, "one-batch") == (None, None)
    write_batch(engine, decoded([fingerprint(agents[3], 400, [11, 99, 33])]), time.time())
    assert replica_columns(engine, "one-batch") == (400, None)
    for agent in agents:
        agent.close()


def fingerprint(agent: FakeAgent, step: int, values: list[int]) -> dict:
    return agent.message("fingerprint", {"step": step, "names": NAMES, "values": values})


def decoded(messages: list[dict]) -> list[dict]:
    return [wire.decode(wire.encode(message)) for message in messages]


def replica_columns(engine, run: str) -> tuple[int | None, int | None]:
    with engine.connect() as conn:
        row = conn.execute(
            select(Run.replica_step, Run.replica_good_step).where(Run.name == run)
        ).one()
    return row.replica_step, row.replica_good_step
