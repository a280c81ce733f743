"""Early warnings through a real ``nand server`` process (issue 18): stored,
never making a run diverged, in the verdict, the warnings list, ``/metrics``
and ``nand wait --until warning``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually
from tests.server.processes import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    db = tmp_path_factory.mktemp("alerts") / "a.db"
    process = ServerProcess(f"sqlite:///{db}", free_port()).start()
    yield process
    process.stop()


def warning(step: int, kind: str = "loss_spike", **fields) -> dict:
    return {
        "kind": kind,
        "step": step,
        "module": "",
        "value": 9.0,
        "reference": 1.0,
        "message": f"{kind} at step {step}",
        "time": 0.0,
        "rank": 0,
        **fields,
    }


def test_warnings_are_counted_and_the_first_is_in_the_verdict(server):
    agents = [FakeAgent(server.zmq_endpoint, run="spiky", rank=r, world_size=2) for r in (0, 1)]
    for agent in agents:
        agent.hello()
        agent.heartbeat(50)
    agents[1].send("warning", warning(42, "grad_growth"))
    agents[0].send("warning", warning(40))
    agents[0].send("warning", warning(45, "headroom", module="blocks.1.mlp", value=4e38))
    for agent in agents:
        agent.wait_acked()
    verdict = httpx.get(f"{server.http_url}/api/runs/spiky/verdict").json()
    assert verdict["state"] == "healthy"  # a warning is never an incident
    found = verdict["warnings"]
    assert found["count"] == 3
    assert found["by_kind"] == {"loss_spike": 1, "grad_growth": 1, "headroom": 1}
    assert (found["first"]["step"], found["first"]["rank"]) == (40, 0)
    listed = httpx.get(f"{server.http_url}/api/runs/spiky/warnings").json()
    assert [(w["step"], w["rank"], w["kind"]) for w in listed] == [
        (40, 0, "loss_spike"),
        (42, 1, "grad_growth"),
        (45, 0, "headroom"),
    ]
    assert (listed[2]["module"], listed[2]["value"]) == ("blocks.1.mlp", 4e38)
    runs = httpx.get(f"{server.http_url}/api/runs").json()
    assert next(r for r in runs if r["run"] == "spiky")["warnings"] == 3
    metrics = httpx.get(f"{server.http_url}/metrics").text
    assert 'nand_warnings{kind="loss_spike"} 1.0' in metrics


def test_nand_wait_until_warning_returns_on_the_first(server):
    (agent,) = [FakeAgent(server.zmq_endpoint, run="waited-warning", rank=0, world_size=1)]
    agent.hello()
    agent.heartbeat(5)
    agent.wait_acked()
    wait = [sys.executable, "-m", "nand", "wait", "waited-warning", "--url", server.http_url]
    waiting = subprocess.Popen(
        [*wait, "--until", "warning", "--timeout", "60"], stdout=subprocess.PIPE, text=True
    )
    # It follows the run's stream (after checking the run exists): the healthy
    # summary is its first, and a poll of the stream's after it.
    eventually(lambda: metric(server, "nand_stream_clients") >= 1, timeout=60)
    polls = metric(server, "nand_stream_polls_total")
    eventually(lambda: metric(server, "nand_stream_polls_total") >= polls + 2, timeout=30)
    assert waiting.poll() is None  # healthy, no warning yet
    agent.send("warning", warning(7))
    agent.wait_acked()
    out, _ = waiting.communicate(timeout=60)
    assert (waiting.returncode, out) == (0, "waited-warning: warning\n")  # (not a healthy state)


def metric(server: ServerProcess, name: str) -> float:
    """A sample of the server's /metrics without labels."""
    for line in httpx.get(f"{server.http_url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_warning_of_an_unknown_kind_is_rejected(server):
    agent = FakeAgent(server.zmq_endpoint, run="odd-warning", rank=0, world_size=1)
    hello = agent.hello()
    agent.send("warning", warning(3, "meltdown"))  # refused: never acknowledged
    beat = agent.send("heartbeat", {"step": 4})
    agent.wait_acked({hello, beat})
    verdict = httpx.get(f"{server.http_url}/api/runs/odd-warning/verdict").json()
    assert verdict["warnings"]["count"] == 0
