"""The transport across real processes: fork, kill -9, and ``nand spool replay``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest

from nand import exitcodes
from nand.agent.identity import Identity
from nand.agent.transport import spool as sp
from nand.agent.transport.server_sink import ServerSink
from nand.testing import Receiver
from nand.testing.ports import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FAST = "ack_timeout_s=0.3, connect_grace_s=0.1, poll_interval_s=0.02"
#: For a test of what exit sends: a loaded CI machine (a CPU hog beside two
#: workers) once took longer than FAST's 0.1 s connect grace plus the default
#: 2 s exit flush, and the three messages stayed in the spool.
PATIENT = "connect_grace_s=10.0, close_timeout_s=30.0, poll_interval_s=0.02"
PRELUDE = """
import json, os, sys, time
from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.events import Event, StepSummary
endpoint, run = sys.argv[1], sys.argv[2]
me = Identity(run=run, rank=0, local_rank=0, world_size=1, host="h", pid=os.getpid())
sink = ServerSink(endpoint, me, SETTINGS)
"""

FORK_CHILD = """
sink.hello({"role": "parent"})
for i in range(10):
    sink.heartbeat(StepSummary(step=i))
assert sink.flush(10)
pid = os.fork()
if pid == 0:  # the forked child uses the very same sink object
    import threading
    lazy = sink._sender is None and threading.active_count() == 1
    for i in range(20):
        sink.heartbeat(StepSummary(step=1000 + i))
    ok = sink.flush(10)
    report = {"who": "child", "agent": sink.agent, "ok": ok, "pid": os.getpid(), "lazy": lazy}
    print(json.dumps(report), flush=True)
    sink.close()
    os._exit(0 if ok else 3)
for i in range(20):
    sink.heartbeat(StepSummary(step=10 + i))
ok = sink.flush(10)
_, status = os.waitpid(pid, 0)
print(json.dumps({"who": "parent", "agent": sink.agent, "ok": ok, "child": status}), flush=True)
sink.close()
"""

KILLED_CHILD = """
sink.hello({})
sink.event(Event(run=run, module="fc1", nan=1), None)
step = 0
while True:
    sink.heartbeat(StepSummary(step=step))
    step += 1
    if step == 300:
        print(sink.agent, flush=True)
    time.sleep(0.002)
"""


def _script(tmp_path: Path, name: str, body: str, settings: str = FAST) -> Path:
    path = tmp_path / name
    prelude = textwrap.dedent(PRELUDE).replace("SETTINGS", settings)
    path.write_text(prelude + textwrap.dedent(body))
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NAND_SPOOL_DIR=str(tmp_path / "spool"))
    env.pop("NAND_SERVER", None)
    return env


def test_a_forked_child_gets_its_own_agent_thread_and_socket_and_both_deliver(tmp_path):
    script = _script(tmp_path, "fork_child.py", FORK_CHILD)
    with Receiver() as rx:
        out = subprocess.run(
            [sys.executable, "-W", "ignore", str(script), rx.endpoint, "run-fork"],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        reports = {r["who"]: r for r in map(json.loads, out.stdout.split("\n")[:-1])}
        parent, child = reports["parent"], reports["child"]
        assert parent["ok"] and child["ok"] and parent["child"] == 0
        assert parent["agent"] != child["agent"]
        assert child["lazy"]  # no thread, no socket in the child until it reports
        assert rx.seqs(parent["agent"]) == list(range(1, 32))  # hello + 30 heartbeats
        assert rx.seqs(child["agent"]) == list(range(1, 22))  # its own hello + 20
        child_hello = rx.messages[child["agent"]][0]
        assert child_hello["kind"] == "hello" and child_hello["body"]["pid"] == child["pid"]
        steps = [m["body"]["step"] for m in rx.messages[child["agent"]][1:]]
        assert steps == list(range(1000, 1020))
        assert rx.duplicates == 0


def _run_and_kill(tmp_path: Path, endpoint: str) -> tuple[str, Path]:
    """Start a producer whose server is down, kill -9 it mid-run; return its spool."""
    script = _script(tmp_path, "killed_child.py", KILLED_CHILD)
    proc = subprocess.Popen(
        [sys.executable, str(script), endpoint, "run-k9"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        agent = proc.stdout.readline().strip()
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL and agent
    return agent, sp.spool_path(tmp_path / "spool", "run-k9", 0)


def test_kill_9_leaves_a_spool_that_the_next_agent_of_the_rank_replays(tmp_path):
    with Receiver() as rx:
        rx.stop()  # the server is down while the first agent runs
        dead_agent, path = _run_and_kill(tmp_path, rx.endpoint)
        records = sp.read_records(path)
        assert len(records) >= 300
        first = [msgpack.unpackb(p)["kind"] for _, p in records[:3]]
        assert first == ["hello", "event", "heartbeat"]
        rx.start()
        me = Identity(run="run-k9", rank=0, local_rank=0, world_size=1, host="h", pid=os.getpid())
        sink = ServerSink(rx.endpoint, me, spool_dir=tmp_path / "spool", ack_timeout_s=0.3)
        sink.hello({})
        assert sink.flush(15), sink.stats()
        sink.close()
        assert rx.seqs(dead_agent) == list(range(1, len(records) + 1))
        assert rx.messages[dead_agent][1]["body"]["event"]["module"] == "fc1"
        assert rx.seqs(sink.agent) == [1]
        assert not path.exists()  # replayed, acknowledged, gone


NAND = [sys.executable, "-m", "nand"]  # the real command line


def test_kill_9_spool_is_replayed_by_nand_spool_replay(tmp_path):
    with Receiver() as rx:
        rx.stop()
        dead_agent, path = _run_and_kill(tmp_path, rx.endpoint)
        kept = tmp_path / "kept"
        kept.mkdir()
        shutil.copy(path, kept / path.name)
        count = len(sp.read_records(path))
        rx.start()
        show = subprocess.run(
            [*NAND, "spool", "show", str(kept)],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert f"{count} records" in show.stdout and "hello" in show.stdout
        replay = [*NAND, "spool", "replay", str(kept), "--server", rx.endpoint]
        out = subprocess.run(replay, env=_env(tmp_path), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"{count}/{count} acknowledged, done" in out.stdout
        assert rx.seqs(dead_agent) == list(range(1, count + 1))
        assert not (kept / path.name).exists()
        again = subprocess.run(
            replay, env=_env(tmp_path), capture_output=True, text=True, timeout=60
        )
        assert again.returncode == exitcodes.NOT_FOUND and "no .spool files there" in again.stderr
        gone = subprocess.run(
            [*NAND, "spool", "show", str(tmp_path / "nonexistent")],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gone.returncode == exitcodes.NOT_FOUND
        assert gone.stderr.startswith("nand: ") and "no such file" in gone.stderr


def test_nand_spool_replay_skips_a_live_agents_file_and_needs_a_server(tmp_path):
    live = sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    live.append(b"\x80", kind="heartbeat")
    env = _env(tmp_path)
    args = [*NAND, "spool", "replay", str(tmp_path)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == exitcodes.USAGE and "needs a server" in out.stderr
    with Receiver() as rx:
        args += ["--server", rx.endpoint, "--timeout", "2"]
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "skipped: a running agent owns it" in out.stdout
    live.close()


EXITING = """
sink.hello({})
sink.heartbeat(StepSummary(step=7))
if sys.argv[3] == "raise":
    raise RuntimeError("training crashed")
"""


@pytest.mark.parametrize("how", ["normal", "raise"])
def test_at_exit_the_sink_flushes_and_says_bye_only_if_the_process_did_not_crash(tmp_path, how):
    script = _script(tmp_path, "exiting.py", EXITING, PATIENT)
    with Receiver() as rx:
        out = subprocess.run(
            [sys.executable, str(script), rx.endpoint, "run-exit", how],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == (0 if how == "normal" else 1), out.stderr
        kinds = [m["kind"] for m in rx.all()]
    if how == "normal":
        assert kinds == ["hello", "heartbeat", "bye"]
        assert rx.all("bye")[0]["body"] == {"step": 7, "reason": "exit"}
    else:
        assert kinds == ["hello", "heartbeat"]  # flushed, but no bye: the server sees a crash


def test_a_job_that_exits_before_its_connection_is_up_waits_for_it_within_the_grace(tmp_path):
    """The process says its last words before the handshake is done (as on a
    loaded host): within the connect grace the sender waits for the server
    instead of spooling what a live server would take."""
    port = free_port()
    script = _script(tmp_path, "exiting.py", EXITING, PATIENT)
    endpoint = f"tcp://127.0.0.1:{port}"
    job = subprocess.Popen(
        [sys.executable, str(script), endpoint, "run-exit", "normal"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)  # (the gap being tested: no server yet while the job ends)
    with Receiver(endpoint) as rx:
        _, err = job.communicate(timeout=60)
        kinds = [m["kind"] for m in rx.all()]
    assert job.returncode == 0, err
    assert kinds == ["hello", "heartbeat", "bye"], err
    assert not list((tmp_path / "spool").rglob("*.spool")), err


NO_SERVER_TRAINING = """
import time, torch, nand
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with nand.watch(model, opt, run="nobody-listens"):
    for step in range(60):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.02)
"""


def test_a_run_whose_server_nobody_reaches_says_so_with_the_spool_and_at_exit(tmp_path):
    """NAND_SERVER pointing at nothing: not silence, but one line after the
    grace period and one at exit, each naming the spool and how to replay it."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(NO_SERVER_TRAINING))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    env = dict(_env(tmp_path), NAND_SERVER=endpoint, NAND_SILENCE_WARN_S="0.5")
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    spool = tmp_path / "spool" / "nobody-listens" / "rank-0.spool"
    said = [line for line in out.stderr.splitlines() if "nothing has reached the server" in line]
    assert len(said) == 1, out.stderr
    assert str(spool) in said[0] and f"nand spool replay {spool} --server {endpoint}" in said[0]
    at_exit = [line for line in out.stderr.splitlines() if "did not reach the server" in line]
    assert len(at_exit) == 1 and str(spool) in at_exit[0], out.stderr
    assert spool.exists() and sp.read_records(spool)
