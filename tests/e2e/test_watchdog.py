"""``nand watchdog`` outside Slurm, as a process: a real server, real ZeroMQ agents
(FakeAgent), a real command with a child of its own. (Under Slurm it cancels the
job instead: tests/e2e/test_slurm.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from nand import exitcodes
from nand.testing import free_port
from tests.e2e.conftest import TOKEN
from tests.e2e.jobs import wait_for
from tests.server.agents import FakeAgent

#: A command with a grandchild (``sleep``), that says what it was given: NAND_RUN, NAND_LAUNCH.
SHELL = 'echo "$NAND_RUN $NAND_LAUNCH" > "$OUT/env"; sleep 300 & echo $! > "$OUT/pid"; wait'


def watchdog(url: str, out: Path, *flags: str, command: str = SHELL) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    words = [sys.executable, "-m", "nand", "watchdog", "--url", url, *flags]
    with open(out / "stderr", "w") as sink:  # (the child has its own copy)
        return subprocess.Popen(
            [*words, "--", "sh", "-c", command],
            env={**env, "OUT": str(out)},
            stdout=sink,
            stderr=sink,
            text=True,
        )


def diverge(agent: FakeAgent, **hello: str) -> None:
    agent.hello(TOKEN, **hello)
    agent.heartbeat(3, steps_per_s=1.0)
    agent.event(step=5, phase="forward", module="fc1", nan=1)
    agent.wait_acked()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def started(out: Path) -> int:
    wait_for(lambda: (out / "pid").exists() and (out / "pid").read_text().strip(), 60, "start")
    return int((out / "pid").read_text())


def test_the_watchdog_stops_the_command_and_its_children_when_the_run_diverges(
    nand_server, tmp_path
):
    proc = watchdog(nand_server.http_url, tmp_path, "--run", "wd", "--launch", "L1")
    grandchild = started(tmp_path)
    assert (tmp_path / "env").read_text().split() == ["wd", "L1"]  # what the agents read
    assert proc.poll() is None
    agent = FakeAgent(nand_server.zmq_endpoint, run="wd")
    try:
        diverge(agent, launch="L1")
        assert proc.wait(60) == exitcodes.DIVERGED
    finally:
        agent.close()
    err = (tmp_path / "stderr").read_text()
    assert "wd: diverged" in err and "fc1" in err, err  # the verdict, on stderr
    wait_for(lambda: gone(grandchild), 10, "the command's child to end")


def test_the_watchdog_ignores_an_earlier_launchs_divergence(nand_server, tmp_path):
    agent = FakeAgent(nand_server.zmq_endpoint, run="again")
    try:
        diverge(agent, launch="L1")
        proc = watchdog(nand_server.http_url, tmp_path, "--run", "again", "--launch", "L2")
        grandchild = started(tmp_path)
        wait_for(lambda: "another launch" in (tmp_path / "stderr").read_text(), 60, "the stream")
        assert proc.poll() is None and not gone(grandchild)
        os.kill(grandchild, signal.SIGKILL)  # the training ends on its own
        assert proc.wait(60) == 0
    finally:
        agent.close()


def test_the_watchdog_exits_with_the_commands_code_when_no_server_answers(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = watchdog(url, tmp_path, "--run", "x", command="sleep 1; exit 5")
    assert proc.wait(60) == 5
    assert "lost the server" in (tmp_path / "stderr").read_text()


def test_a_signal_to_the_watchdog_reaches_the_commands_processes(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = watchdog(url, tmp_path, "--run", "x")
    grandchild = started(tmp_path)  # (the watchdog's handlers are set as the command starts)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    wait_for(lambda: gone(grandchild), 10, "the command's child to end")


def test_the_watchdog_refuses_no_command_and_no_run_id(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NAND_RUN"))}
    for words, said in (
        (["--run", "x"], "no training command"),
        (["--", "true"], "no run id"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "nand", "watchdog", *words],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == exitcodes.USAGE and said in done.stderr, done.stderr


def test_the_watchdog_waits_for_the_rank_that_made_the_value_before_ending_the_job(
    nand_server, tmp_path
):
    """A rank that received the value through the all-reduce reports first; the one
    that made it reports after its replay. Cancelled in between, the job would
    lose the answer: the watchdog waits (``--settle``) for it."""
    ranks = [FakeAgent(nand_server.zmq_endpoint, run="s", rank=r, world_size=2) for r in (0, 1)]
    try:
        for agent in ranks:
            agent.hello(TOKEN, launch="L")
            agent.heartbeat(3, steps_per_s=1.0)
            agent.wait_acked()
        proc = watchdog(nand_server.http_url, tmp_path, "--run", "s", "--launch", "L")
        started(tmp_path)
        ranks[0].event(step=5, phase="grad", module="fc1.weight", cause="received", nan=1)
        said = "waiting up to 10 s for the rank that made it"
        wait_for(lambda: said in (tmp_path / "stderr").read_text(), 60, "the watchdog to wait")
        assert proc.poll() is None
        ranks[1].event(step=5, phase="forward", module="fc2", cause="produced", nan=1)
        assert proc.wait(60) == exitcodes.DIVERGED
    finally:
        for agent in ranks:
            agent.close()
    err = (tmp_path / "stderr").read_text()
    assert "s: diverged\nrank 1 produced" in err, err
