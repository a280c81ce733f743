"""A run id used again is a new attempt (a re-applied Kubernetes Job keeps its
name): through a real ``nand server`` process, real ZeroMQ agents, the REST API
and ``nand wait`` as a CLI process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from nand import exitcodes
from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually
from tests.server.processes import ServerProcess

TOKEN = "attempts-token"
LOST_AFTER_S = 2.0


@pytest.fixture
def server(tmp_path):
    process = ServerProcess(
        f"sqlite:///{tmp_path / 'a.db'}",
        free_port(),
        NAND_TOKEN=TOKEN,
        NAND_LOST_AFTER_S=str(LOST_AFTER_S),
    ).start()
    yield process
    process.stop()


@pytest.fixture
def connect(server):
    """Make agents connected to the server; closed at teardown."""
    made: list[FakeAgent] = []

    def make(run: str, rank: int, world_size: int = 2, agent: str | None = None) -> FakeAgent:
        made.append(
            FakeAgent(server.zmq_endpoint, run=run, rank=rank, world_size=world_size, agent=agent)
        )
        return made[-1]

    yield make
    for agent in made:
        agent.close()


def launch_job(connect, run: str, pid_base: int, **hello: Any) -> list[FakeAgent]:
    """The pods of one launch: two ranks, new processes (pids) every launch."""
    ranks = [connect(run, rank) for rank in range(2)]
    for agent in ranks:
        agent.hello(TOKEN, pid=pid_base + agent.rank, **hello)
        agent.heartbeat(3, steps_per_s=1.0)
    settle(ranks)
    return ranks


def settle(agents: list[FakeAgent]) -> None:
    for agent in agents:
        agent.wait_acked()


def get(server: ServerProcess, path: str) -> Any:
    response = httpx.get(f"{server.http_url}{path}")
    response.raise_for_status()
    return response.json()


def live(server: ServerProcess, run: str) -> tuple[int, str]:
    verdict = get(server, f"/api/runs/{run}/verdict")
    return verdict["attempt"], verdict["state"]


def nand_wait(server: ServerProcess, run: str, *flags: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "nand", "wait", run, "--url", server.http_url, *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def metric(server: ServerProcess, name: str) -> float:
    """A sample of the server's /metrics without labels."""
    for line in httpx.get(f"{server.http_url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def stream_turns(server: ServerProcess, turns: int, alive: list[FakeAgent]) -> None:
    """Wait until the server's stream poller took ``turns`` more turns: what
    was stored before is on every open stream. The ``alive`` ranks beat
    meanwhile (silent for ``LOST_AFTER_S``, they would be lost)."""
    start = metric(server, "nand_stream_polls_total")
    beating(alive, lambda: metric(server, "nand_stream_polls_total") >= start + turns)


def beating(alive: list[FakeAgent], check: Callable[[], bool], timeout: float = 60) -> None:
    """Wait for ``check``, the ``alive`` ranks beating at their step meanwhile."""

    def beat_and_check() -> bool:
        for agent in alive:
            agent.heartbeat(3, steps_per_s=1.0)
        return check()

    eventually(beat_and_check, timeout=timeout, interval=0.2)


def finish(agents: list[FakeAgent], step: int = 4) -> None:
    for agent in agents:
        agent.bye(step)
    settle(agents)


def test_a_new_launch_after_a_diverged_one_is_a_new_attempt_and_wait_waits_for_it(
    server, connect
) -> None:
    first = launch_job(connect, "train", pid_base=100, launch="uid-1")
    first[1].event(step=5, phase="forward", module="fc1", nan=1)
    settle(first)
    assert live(server, "train") == (1, "diverged")

    # The re-applied Job's watchdog starts before its trainer says hello.
    watchdog = nand_wait(server, "train", "--until", "diverged", "--launch", "uid-2")
    plain = nand_wait(server, "train", "--until", "any", "--timeout", "60")
    assert plain.wait(30) == exitcodes.DIVERGED  # without --launch: last time's state
    assert watchdog.stderr is not None
    said = watchdog.stderr.readline()  # it saw attempt 1, diverged, and said why it waits on
    assert "another launch" in said and "waiting for launch uid-2" in said, said
    assert watchdog.poll() is None, watchdog.communicate()

    second = launch_job(connect, "train", pid_base=200, launch="uid-2")
    assert live(server, "train") == (2, "healthy")
    stream_turns(server, 2, second)  # the watchdog's stream has carried attempt 2, healthy
    assert watchdog.poll() is None, watchdog.communicate()  # did not act on attempt 1

    second[0].event(step=9, phase="loss", module="", nan=1)
    settle(second)
    out, err = watchdog.communicate(timeout=30)
    assert watchdog.returncode == exitcodes.OK, said + err
    assert out.strip() == "train: diverged"


def test_a_rerun_without_launch_id_is_a_new_attempt_once_the_old_ranks_ended(
    server, connect
) -> None:
    first = launch_job(connect, "rerun", pid_base=100)
    first[0].event(step=5, phase="forward", module="fc1", nan=1)
    finish(first)
    assert live(server, "rerun") == (1, "diverged")

    second = launch_job(connect, "rerun", pid_base=200)
    assert live(server, "rerun") == (2, "healthy")
    waiting = nand_wait(server, "rerun", "--until", "any", "--timeout", "60")
    beating(second, lambda: metric(server, "nand_stream_clients") >= 1)  # (it starts)
    stream_turns(server, 2, second)  # its stream has carried attempt 2, healthy
    assert waiting.poll() is None, waiting.communicate()
    finish(second, step=10)
    out, err = waiting.communicate(timeout=30)
    assert (waiting.returncode, out.strip()) == (exitcodes.OK, "rerun: finished"), err


def test_a_rerun_after_the_old_ranks_went_silent_is_a_new_attempt(server, connect) -> None:
    launch_job(connect, "killed", pid_base=100)  # killed: no bye, just silence
    eventually(lambda: live(server, "killed") == (1, "lost"), timeout=LOST_AFTER_S + 30)
    launch_job(connect, "killed", pid_base=200)
    assert live(server, "killed") == (2, "healthy")


def test_earlier_attempts_stay_readable(server, connect) -> None:
    first = launch_job(connect, "history", pid_base=100, launch="uid-1")
    first[1].event(step=5, phase="forward", module="fc1", nan=1)
    settle(first)
    launch_job(connect, "history", pid_base=200, launch="uid-2")

    detail = get(server, "/api/runs/history")
    assert (detail["attempt"], detail["launch"], detail["live"]) == (2, "uid-2", True)
    attempts = [(a["attempt"], a["launch"]) for a in detail["attempts"]]
    assert attempts == [(1, "uid-1"), (2, "uid-2")]
    assert detail["attempts"][0]["superseded_at"] is not None
    assert detail["attempts"][1]["superseded_at"] is None

    old = get(server, "/api/runs/history/verdict?attempt=1")
    assert (old["attempt"], old["state"], old["live"], old["stoppable"]) == (
        1,
        "diverged",
        False,
        False,
    )
    assert old["origin"]["rank"] == 1
    assert [e["rank"] for e in get(server, "/api/runs/history/events?attempt=1")["items"]] == [1]
    assert get(server, "/api/runs/history/events")["items"] == []
    assert sorted(r["pid"] for r in get(server, "/api/runs/history/ranks")["items"]) == [200, 201]
    assert sorted(r["pid"] for r in get(server, "/api/runs/history/ranks?attempt=1")["items"]) == [
        100,
        101,
    ]
    listed = [(r["run"], r["attempt"]) for r in get(server, "/api/runs")]
    assert listed == [("history", 2)]
    missing = httpx.get(f"{server.http_url}/api/runs/history/verdict?attempt=3")
    assert missing.status_code == 404 and "attempt 3" in missing.json()["detail"]


def test_a_stop_goes_to_the_live_attempt_only(server, connect) -> None:
    launch_job(connect, "stops", pid_base=100, launch="uid-1")
    launch_job(connect, "stops", pid_base=200, launch="uid-2")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    old = httpx.post(f"{server.http_url}/api/runs/stops/stop?attempt=1", headers=auth)
    assert old.status_code == 409 and "newer" in old.json()["detail"]
    stop = httpx.post(f"{server.http_url}/api/runs/stops/stop", headers=auth)
    assert stop.status_code == 200, stop.text
    assert live(server, "stops")[0] == 2
    assert get(server, "/api/runs/stops/verdict")["stop"]["step"] == stop.json()["step"]
    assert get(server, "/api/runs/stops/verdict?attempt=1")["stop"] is None


def test_a_reconnecting_agent_stays_in_its_attempt(server, connect) -> None:
    first = launch_job(connect, "same", pid_base=100)
    first[0].event(step=5, phase="forward", module="fc1", nan=1)
    finish(first)  # every rank ended: the next new process would start attempt 2
    # The same agent on a new connection (after a network blip: the old one is
    # gone), saying hello again. Until the server has seen the old connection go,
    # the new one is refused as a second live one: it resends, as a real agent does.
    first[0].close()
    again = connect("same", 0, agent=first[0].agent)
    again.seq = first[0].seq
    again.send_until_acked("hello", again.hello_body(TOKEN, pid=100))
    again.heartbeat(6)
    again.wait_acked({again.seq - 1, again.seq})
    assert live(server, "same") == (1, "diverged")
    assert get(server, "/api/runs/same")["attempts"][-1]["attempt"] == 1


def test_a_second_watch_in_the_same_process_stays_in_its_attempt(server, connect) -> None:
    launch_job(connect, "one", pid_base=100)
    other = connect("one", 0)  # a new agent id, the same process (host, pid)
    other.hello(TOKEN, pid=100)
    other.wait_acked()
    assert live(server, "one")[0] == 1


def test_late_ranks_and_forked_workers_of_a_live_attempt_stay_in_it(server, connect) -> None:
    ranks = [connect("late", 0, world_size=3)]
    ranks[0].hello(TOKEN, pid=100)
    ranks[0].heartbeat(2)
    settle(ranks)
    late = connect("late", 2, world_size=3)  # its rank was free
    late.hello(TOKEN, pid=102)
    worker = connect("late", 0, world_size=3)  # a DataLoader worker of rank 0: another pid
    worker.hello(TOKEN, pid=150)
    settle([late, worker])
    assert live(server, "late")[0] == 1
    assert get(server, "/api/runs/late")["ranks_seen"] == 2


def test_a_late_rank_of_an_older_launch_goes_to_its_own_attempt(server, connect) -> None:
    launch_job(connect, "split", pid_base=100, launch="uid-1")
    launch_job(connect, "split", pid_base=200, launch="uid-2")
    straggler = connect("split", 1)
    straggler.hello(TOKEN, pid=111, launch="uid-1")
    straggler.event(step=4, phase="grad", module="fc1.weight", nan=1)
    straggler.wait_acked()
    assert live(server, "split") == (2, "healthy")
    old = eventually(lambda: get(server, "/api/runs/split/verdict?attempt=1"))
    assert old["state"] == "diverged"
