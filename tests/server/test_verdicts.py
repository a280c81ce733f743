"""Verdicts a person on call can trust (issue 19), through a real ``nand server``
process, its REST API and the ``nand`` command line: hints that follow the
evidence, the host named, no GPU blamed on a CPU run, the value kind kept, no
rank named first when none was, crashed ranks, and stops that can take effect."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from nand import exitcodes
from nand.server.agents import ingest
from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.processes import ServerProcess

TOKEN = "tok"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    db = tmp_path_factory.mktemp("verdicts") / "v.db"
    process = ServerProcess(f"sqlite:///{db}", free_port(), NAND_TOKEN=TOKEN).start()
    yield process
    process.stop()


def join(server: ServerProcess, run: str, world: int, device: str = "cpu") -> list[FakeAgent]:
    ranks = [
        FakeAgent(server.zmq_endpoint, run=run, rank=r, world_size=world) for r in range(world)
    ]
    for agent in ranks:
        agent.hello(token=TOKEN, device=device)
        agent.heartbeat(10, steps_per_s=1.0)
    return ranks


def settle(agents: list[FakeAgent]) -> None:
    for agent in agents:
        agent.wait_acked()


def verdict(server: ServerProcess, run: str) -> dict:
    return httpx.get(f"{server.http_url}/api/runs/{run}/verdict").json()


def nand(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nand", *args], capture_output=True, text=True, timeout=60
    )


def test_a_shard_written_after_the_step_is_not_blamed_on_the_learning_rate(server) -> None:
    ranks = join(server, "fsdp-shard", 4)
    ranks[1].event(
        step=30,
        phase="param",
        module="blocks.1.fc2.weight",
        module_type="Linear",
        posinf=1,
        shape=[64, 32],
        max_abs=0.25,
        dtype="float32",
        host="host-1",
    )
    for agent in ranks:
        if agent.rank != 1:
            agent.event(step=31, phase="forward", module="blocks.1.fc2", nan=3, host="host-x")
    settle(ranks)
    found = verdict(server, "fsdp-shard")
    assert found["hint"] == "param_written"
    assert "learning rate" not in found["summary"] and "GPU" not in found["summary"]
    assert (
        "Only rank 1 (host host-1) produced it: suspect code that writes its weights."
        in (found["summary"])
    )


def test_a_nan_activation_keeps_its_kind_on_sqlite(server) -> None:
    ranks = join(server, "nan-kind", 2)
    nan = math.nan  # the cheap path: only a NaN-propagating min/max, no counts
    ranks[0].event(step=5, phase="forward", module="fc1", module_type="Linear", min=nan, max=nan)
    ranks[1].event(step=5, phase="grad", module="fc1.weight", nan=2)
    settle(ranks)
    found = verdict(server, "nan-kind")
    assert found["origin"]["values"] == "NaN"
    assert (
        "produced NaN in fc1" in found["summary"] and "a non-finite value" not in found["summary"]
    )
    events = httpx.get(f"{server.http_url}/api/runs/nan-kind/events?rank=0").json()
    assert events["items"][0]["values"] == "NaN"


def test_a_rank_that_left_with_an_exception_is_crashed_not_finished(server) -> None:
    ranks = join(server, "reset-by-peer", 2)
    ranks[0].bye(12, "exception: RuntimeError")  # gloo: Connection reset by peer
    ranks[1].bye(12, "closed")
    settle(ranks)
    found = verdict(server, "reset-by-peer")
    assert found["state"] == "crashed" and "rank 0 crashed" in found["summary"]
    states = {
        r["rank"]: r["state"]
        for r in httpx.get(f"{server.http_url}/api/runs/reset-by-peer/ranks").json()["items"]
    }
    assert states == {0: "crashed", 1: "finished"}
    waited = nand("wait", "reset-by-peer", "--url", server.http_url, "--timeout", "20")
    assert waited.returncode == exitcodes.CRASHED, waited.stderr


def test_stop_is_refused_once_every_rank_has_exited(server) -> None:
    ranks = join(server, "all-gone", 2)
    ranks[0].event(step=11, phase="forward", module="fc1", nan=1)
    for agent in ranks:
        agent.bye(11, "exception: NonFiniteError")
    settle(ranks)
    assert verdict(server, "all-gone")["stoppable"] is False
    done = nand("stop", "all-gone", "--url", server.http_url, "--token", TOKEN)
    assert done.returncode == exitcodes.ERROR
    assert "no rank left to stop" in done.stderr and len(done.stderr.splitlines()) == 1
    assert verdict(server, "all-gone")["stop"] is None


def test_a_live_stop_says_at_or_after_and_shows_the_step_it_took_effect(server) -> None:
    ranks = join(server, "live-stop", 2)
    settle(ranks)
    assert verdict(server, "live-stop")["stoppable"] is True
    done = nand("stop", "live-stop", "--url", server.http_url, "--token", TOKEN)
    assert done.returncode == 0, done.stderr
    assert "every rank stops at step 20 or the next step boundary after it" in done.stdout
    for agent in ranks:  # the agents reach the boundary later than announced
        agent.bye(23, "exception: StopRequested")
    settle(ranks)
    found = verdict(server, "live-stop")
    assert found["stop"]["step"] == 20 and found["stop"]["stopped_at"] == 23
    assert found["state"] == "finished"  # a requested stop is a clean end, not a crash


class IngestClock:
    """The embedded server's ingest clock, set by the test: the times it stamps on
    what it stores (last seen, byes, step changes) are the test's to choose."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)  # (perf_counter and the rest: the real clock's)


@pytest.fixture
def clocked(start_server, monkeypatch):
    """An embedded server whose ingest reads :class:`IngestClock` (REST reads the real
    clock); a rank silent or without progress for 60 s is lost or stalled."""
    clock = IngestClock()
    monkeypatch.setattr(ingest, "time", clock)
    server = start_server(token=TOKEN, lost_after_s=60.0, stalled_after_s=60.0, heartbeat_s=1.0)
    return server, clock


def at(clock: IngestClock, when: float, agent: FakeAgent, send) -> None:
    """``send`` from ``agent``, stored at ``when`` on the server's clock."""
    clock.now = when
    send()
    agent.wait_acked()


def plant_failures(server, clock: IngestClock, run: str, when: dict[str, float]) -> None:
    """Four ranks, one failure each, at the server times in ``when``: rank 2 goes
    non-finite, rank 1 falls silent (SIGKILL), rank 0 leaves with an exception,
    rank 3 stops making progress while its heartbeats go on."""
    ranks = [FakeAgent(server.zmq_endpoint, run=run, rank=r, world_size=4) for r in range(4)]
    start = min(when.values()) - 10
    for agent in ranks:
        at(clock, start, agent, lambda a=agent: a.hello(token=TOKEN))
    nonfinite, lost, crashed, stalled = ranks[2], ranks[1], ranks[0], ranks[3]
    at(
        clock,
        when["diverged"],
        nonfinite,
        lambda: nonfinite.event(
            step=5,
            phase="forward",
            module="fc1",
            module_type="Linear",
            nan=1,
            time=when["diverged"],
        ),
    )
    at(clock, when["lost"], lost, lambda: lost.heartbeat(5, steps_per_s=10.0))
    at(clock, when["crashed"], crashed, lambda: crashed.bye(5, "exception: RuntimeError"))
    at(clock, when["stalled"] - 0.1, stalled, lambda: stalled.heartbeat(5, steps_per_s=10.0))
    at(clock, time.time(), stalled, lambda: stalled.heartbeat(5, steps_per_s=10.0))  # alive
    for agent in ranks:
        agent.close()


ORDERS = [
    ("diverged", "lost", "crashed", "stalled"),
    ("lost", "crashed", "diverged", "stalled"),
    ("stalled", "crashed", "lost", "diverged"),
    ("crashed", "stalled", "diverged", "lost"),
]


@pytest.mark.parametrize("order", ORDERS, ids="-then-".join)
def test_the_verdict_names_the_first_failure_in_time_and_the_later_ones_as_consequences(
    clocked, order
) -> None:
    server, clock = clocked
    base = time.time() - 1000  # long enough ago that a silent rank is lost
    when = {state: base + 100 * i for i, state in enumerate(order)}
    run = "-".join(order)
    plant_failures(server, clock, run, when)
    found = httpx.get(f"{server.http_url}/api/runs/{run}/verdict").json()
    assert found["state"] == order[0], found["summary"]
    ranks = {"diverged": [2], "lost": [1], "crashed": [0], "stalled": [3]}
    assert [(f["state"], f["ranks"]) for f in found["failures"]] == [
        (state, ranks[state]) for state in order
    ], found["summary"]
    listed = httpx.get(f"{server.http_url}/api/runs").json()
    assert next(r for r in listed if r["run"] == run)["state"] == order[0]
    text = found["summary"]
    first = {
        "diverged": "rank 2 produced NaN",
        "lost": "rank 1 lost",
        "crashed": "rank 0 crashed",
        "stalled": "rank 3 stalled",
    }
    assert text.startswith(first[order[0]]), text
    later = text[text.index("Then, as consequences: ") :]
    named = {
        "diverged": "rank 2 went non-finite",
        "lost": "rank 1 went silent (lost)",
        "crashed": "rank 0 crashed",
        "stalled": "rank 3 stalled",
    }
    assert [later.find(named[state]) for state in order[1:]] == sorted(
        later.find(named[state]) for state in order[1:]
    ) and all(named[state] in later for state in order[1:]), text
    assert f"{named[order[1]]} 1.7 min later" in later, text


def test_a_rank_silent_just_after_another_crashed_is_still_the_origin(clocked) -> None:
    """A killed rank's last heartbeat may reach the server a moment after the bye
    of the peer its death made raise: within a heartbeat the silent rank is first."""
    server, clock = clocked
    base = time.time() - 1000
    survivor, victim = (
        FakeAgent(server.zmq_endpoint, run="race", rank=r, world_size=2) for r in range(2)
    )
    for agent in (survivor, victim):
        at(clock, base, agent, lambda a=agent: a.hello(token=TOKEN))
    at(clock, base + 5.0, survivor, lambda: survivor.bye(5, "exception: RuntimeError"))
    at(clock, base + 5.4, victim, lambda: victim.heartbeat(5, steps_per_s=10.0))
    found = httpx.get(f"{server.http_url}/api/runs/race/verdict").json()
    assert found["state"] == "lost"
    assert [(f["state"], f["ranks"]) for f in found["failures"]] == [
        ("lost", [1]),
        ("crashed", [0]),
    ]
    assert found["summary"].startswith("rank 1 lost"), found["summary"]
    assert (
        "rank 0 crashed at about the same time (left with an exception: RuntimeError"
        in (found["summary"])
    )
