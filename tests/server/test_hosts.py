"""Repeat offenders across runs (issue 18): ``GET /api/hosts`` and ``nand hosts``
on a real ``nand server`` process fed over ZeroMQ. Ground truth by
construction: which rank (on which host and GPU) produced each run's NaN,
which ranks only received it, which differed from the other replicas."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.processes import ServerProcess

HOSTS = {0: "node-a", 1: "node-b", 2: "node-b", 3: "node-c"}
DEVICES = {0: "cuda:0", 1: "cuda:0", 2: "cuda:1", 3: "cuda:0"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    db = tmp_path_factory.mktemp("hosts") / "h.db"
    process = ServerProcess(f"sqlite:///{db}", free_port()).start()
    try:
        for n in range(3):  # rank 2 (node-b, GPU 1) produces the NaN; the others receive it
            diverged(process, f"lemon-{n}", origin=2)
        diverged(process, "together", origin=None)  # every rank at once: the model, not a host
        mismatched(process, "drifted", odd=3)
        yield process
    finally:
        process.stop()


def join(server: ServerProcess, run: str) -> list[FakeAgent]:
    agents = [FakeAgent(server.zmq_endpoint, run=run, rank=r, world_size=4) for r in range(4)]
    for agent in agents:
        agent.hello(host=HOSTS[agent.rank], device=DEVICES[agent.rank])
    return agents


def diverged(server: ServerProcess, run: str, origin: int | None) -> None:
    agents = join(server, run)
    for agent in agents:
        if origin is None or agent.rank == origin:
            agent.event(step=5, phase="forward", module="fc1", cause="produced")
        else:
            agent.event(step=5, phase="grad", module="fc1.weight", cause="received")
    finish(agents)


def mismatched(server: ServerProcess, run: str, odd: int) -> None:
    agents = join(server, run)
    for agent in agents:
        values = [1, 2] if agent.rank != odd else [1, 3]
        agent.send("fingerprint", {"step": 100, "names": ["w", "b"], "values": values})
    finish(agents)


def finish(agents: list[FakeAgent]) -> None:
    for agent in agents:
        agent.wait_acked()
        agent.close()


def test_the_host_whose_gpu_produced_every_nan_comes_first(server):
    page = httpx.get(f"{server.http_url}/api/hosts").json()
    assert page["total"] == 3 and page["runs"] == 5
    first, *rest = page["items"]
    assert (first["host"], first["incidents"], first["mismatches"]) == ("node-b", 3, 0)
    assert [(g["gpu"], g["incidents"]) for g in first["gpus"]] == [(0, 0), (1, 3)]
    by_host = {h["host"]: h for h in rest}
    assert by_host["node-c"]["mismatches"] == 1 and by_host["node-c"]["incidents"] == 0
    assert by_host["node-a"]["incidents"] == 0  # it only received the NaNs
    assert [h["host"] for h in rest] == ["node-c", "node-a"]


def test_nand_hosts_lists_them_worst_first(server):
    command = [sys.executable, "-m", "nand", "hosts", "--url", server.http_url]
    table = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    lines = table.stdout.splitlines()
    assert lines[1].split()[:4] == ["node-b", "3", "0", "0"]
    assert "1: 3/0/0" in lines[1]
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True)
    assert json.loads(as_json.stdout)["items"][0]["host"] == "node-b"
