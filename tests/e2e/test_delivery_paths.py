"""Every kind of agent message through every delivery path, to a real ``nand server``.

The kinds are ``nand.wire.AGENT_KINDS`` (a new kind joins the matrix by
itself, and fails it until ``tests/e2e/delivery.py`` can send and find it).
The paths are those a message can take from ``ServerSink`` to the database:

- ``direct``: the server is up;
- ``memory``: the server does not answer yet (stopped with SIGSTOP), within
  the connect grace: the messages wait in memory, then go out directly;
- ``spool``: the same past the grace: they wait on disk, then are replayed;
- ``reconnect``: the server is killed mid-run and started again: what was
  sent meanwhile is spooled and replayed when the agent reconnects;
- ``spool_replay``: the server is never reached; ``nand spool replay`` sends
  the spool the agent left at exit;
- ``adoption``: the agent's process is killed (``kill -9``) with its spool;
  the next agent of the same run and rank adopts and replays it;
- ``compaction``: a long outage fills the spool, which is compacted: every
  kind is still stored, and what compaction dropped is counted lost by reason.

One server process for the module (a paused or restarted server comes back
as it was); one run per path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nand import wire
from nand.agent.transport import spool as sp
from nand.agent.transport.server_sink import ServerSink
from nand.events import StepSummary
from nand.testing import free_endpoint, free_port
from tests.e2e import delivery
from tests.e2e.jobs import api
from tests.server.agents import FakeAgent
from tests.server.processes import ServerProcess

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FAST = {"ack_timeout_s": 0.5, "connect_grace_s": 0.1, "poll_interval_s": 0.02, "keepalive_s": 3600}
KINDS = len(wire.AGENT_KINDS)


class Server(ServerProcess):
    """The module's server, which tests may pause or kill and start again."""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not answering (SIGSTOP): connections are not made, nothing is acknowledged."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        status = Path(f"/proc/{self.proc.pid}/status")
        _until(lambda: "\nState:\tT" in status.read_text(), "the server to stop")  # (not at once)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("paths") / "nand.db"
    process = Server(f"sqlite:///{db}", free_port()).start()
    try:
        yield process
    finally:
        process.stop()


def _until(predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _delivered(sink: ServerSink) -> dict[str, Any]:
    assert sink.flush(30), sink.stats()
    stats = sink.stats()
    sink.close()
    return stats


# --- the paths: each sends one message of every kind as rank 0 of ``run`` ---


def direct(server: Server, run: str, tmp_path: Path) -> None:
    sink = ServerSink(server.zmq_endpoint, delivery.identity(run), **FAST)
    delivery.send_all(sink, run)
    assert _delivered(sink)["spooled"] == 0


def memory(server: Server, run: str, tmp_path: Path) -> None:
    patient = {**FAST, "connect_grace_s": 60.0}  # (waits in memory, not on disk)
    sink = ServerSink(server.zmq_endpoint, delivery.identity(run), **patient)
    with server.paused():
        delivery.send_all(sink, run)
        _until(lambda: sink.stats().get("memory_frames") == KINDS, "every message in memory")
        assert not sink.stats()["connected"]
    stats = _delivered(sink)
    assert stats["spooled"] == 0 and stats["sent"] >= KINDS


def spool(server: Server, run: str, tmp_path: Path) -> None:
    sink = ServerSink(server.zmq_endpoint, delivery.identity(run), **FAST)
    with server.paused():
        delivery.send_all(sink, run)
        _until(lambda: sink.stats().get("spooled") == KINDS, "every message on disk")
    stats = _delivered(sink)
    assert stats["replayed"] >= KINDS


def reconnect(server: Server, run: str, tmp_path: Path) -> None:
    sink = ServerSink(server.zmq_endpoint, delivery.identity(run), **FAST)
    sink.heartbeat(StepSummary(step=0))
    assert sink.flush(30)  # connected: one heartbeat acknowledged
    server.kill9()
    delivery.send_all(sink, run)
    _until(lambda: sink.stats()["spooled"] >= KINDS, "every message on disk")
    server.start()
    stats = _delivered(sink)
    assert stats["replayed"] >= KINDS


def spool_replay(server: Server, run: str, tmp_path: Path) -> None:
    sink = ServerSink(free_endpoint(), delivery.identity(run), **FAST)
    delivery.send_all(sink, run)
    sink.close(2.0)
    left = sp.spool_path(sink.settings.spool_dir, run, 0)
    assert len(sp.read_records(left)) == KINDS
    command = [sys.executable, "-m", "nand", "spool", "replay", str(left.parent)]
    done = subprocess.run(
        [*command, "--server", server.zmq_endpoint],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and f"{KINDS}/{KINDS} acknowledged, done" in done.stdout, (
        done.stdout + done.stderr
    )


KILLED = """
import sys, time
from nand.agent.transport.server_sink import ServerSink
from nand.testing import free_endpoint
from tests.e2e import delivery
run = sys.argv[1]
sink = ServerSink(free_endpoint(), delivery.identity(run), connect_grace_s=0.1)
delivery.send_all(sink, run)
while sink.stats().get("spooled") != len(delivery.wire.AGENT_KINDS):
    time.sleep(0.01)
print("spooled", flush=True)
time.sleep(600)  # until killed
"""


def adoption(server: Server, run: str, tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(script), run], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "spooled"
    finally:
        proc.kill()  # SIGKILL: no atexit, no flush, the spool stays as it was
        proc.wait(10)
    dead = sp.spool_path(os.environ["NAND_SPOOL_DIR"], run, 0)
    assert len(sp.read_records(dead)) == KINDS
    successor = ServerSink(server.zmq_endpoint, delivery.identity(run), **FAST)
    successor.heartbeat(StepSummary(step=0))  # its first message starts it: it adopts the spool
    stats = _delivered(successor)
    assert stats["replayed"] >= KINDS and not dead.exists()


def compaction(server: Server, run: str, tmp_path: Path) -> None:
    limit = 16 * 1024
    sink = ServerSink(
        server.zmq_endpoint, delivery.identity(run), **{**FAST, "spool_max_bytes": limit}
    )
    path = sp.spool_path(sink.settings.spool_dir, run, 0)
    beats = 0

    def flood() -> None:  # heartbeats until the spool was compacted and has room again
        nonlocal beats
        while not (sink.dropped() and path.stat().st_size < 0.6 * limit):
            beats += _spooled_heartbeat(sink, step=1000 + beats)

    def last_heartbeat() -> None:  # carries the final loss counts
        nonlocal beats
        beats += _spooled_heartbeat(sink, step=2000)

    with server.paused():
        delivery.send_all(sink, run, after_hello=flood, before_bye=last_heartbeat)
        final = sink.dropped()
        _until(lambda: sink.stats()["spooled"] >= beats + KINDS, "the bye on disk")
        assert sink.dropped() == final, "compacted after the last heartbeat: make room first"
    _delivered(sink)
    rank0 = next(r for r in api(server.http_url, run, "/ranks")["items"] if r["rank"] == 0)
    stored = next(s for s in api(server.http_url, run, "/series?points=5000") if s["rank"] == 0)
    assert rank0["dropped"] == final and set(final) == {"spool_full"}
    assert len(stored["points"]) + final["spool_full"] == beats + 1  # (+ the matrix's own)


def _spooled_heartbeat(sink: ServerSink, step: int) -> int:
    before = sink.stats().get("spooled", 0)
    sink.heartbeat(StepSummary(step=step))
    _until(lambda: sink.stats()["spooled"] > before, "a heartbeat on disk")
    return 1


PATHS = [direct, memory, spool, reconnect, spool_replay, adoption, compaction]


def test_every_kind_of_agent_message_can_be_sent_and_found_by_the_matrix():
    assert set(delivery.SEND) == set(delivery.FIND) == set(wire.AGENT_KINDS)


@pytest.mark.parametrize("path", PATHS, ids=[p.__name__ for p in PATHS])
def test_every_kind_of_agent_message_is_stored_by_the_server_through_this_path(
    server, tmp_path, path
):
    run = f"paths-{path.__name__}"
    # Rank 1 of the run, directly: the other fingerprint, against which rank 0's is compared.
    rank1 = FakeAgent(server.zmq_endpoint, run=run, rank=1, world_size=2)
    rank1.hello()
    fingerprint = {"step": delivery.STEP, "names": delivery.PARAMS, "values": delivery.PRINT}
    rank1.send("fingerprint", fingerprint)
    rank1.wait_acked()
    rank1.close()
    path(server, run, tmp_path)
    assert delivery.missing(server.http_url, run) == []
    verdict = api(server.http_url, run, "/verdict")
    if path is not compaction:
        assert verdict["messages_dropped"] == 0, verdict["dropped"]
