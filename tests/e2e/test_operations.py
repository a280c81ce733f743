"""Operating real jobs: stop every rank at one step, a rank killed with -9,
the scheduler watchdog wrapper, and the one-command demo."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nand.client import request_json, run_url
from nand.demo import faults as demo_faults
from nand.server.embedded import EmbeddedServer
from tests.e2e.conftest import TOKEN, embedded_test_server
from tests.e2e.jobs import TRAINER, agent_env, api, launch, torchrun, wait_for

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def ranks_at_step(base: str, run: str, count: int, step: int):
    def check():
        statuses = api(base, run, "/ranks")["items"]
        return len(statuses) == count and all(s["step"] >= step for s in statuses) and statuses

    return check


def test_rest_stop_stops_every_rank_at_the_same_step(tmp_path):
    # The stop step lies two of the server's heartbeat periods of training
    # ahead (stoprule.py): with the tests' 0.5 s that is 1 s for the command
    # to reach every rank, which a loaded CI machine once exceeded (one rank
    # stopped at 14, the other went on into a dead all-reduce). 2 s gives 4 s;
    # the agents still report every 0.5 s.
    with embedded_test_server(tmp_path, heartbeat_s=2.0, lost_after_s=10.0) as server:
        _stop_every_rank(server, tmp_path)


def _stop_every_rank(nand_server: EmbeddedServer, tmp_path: Path) -> None:
    run = "stopped"
    env = agent_env(nand_server.zmq_endpoint, run, TOKEN)
    args = ["--steps", "2000", "--step-time", "0.05", "--policy", "warn"]
    job = launch([*torchrun(2), *TRAINER, *args], env, tmp_path / "stop.log")
    wait_for(ranks_at_step(nand_server.http_url, run, 2, 3), 90, "both ranks to train")

    answer = request_json(
        run_url(nand_server.http_url, run, "/stop"), method="POST", body={}, token=TOKEN
    )
    assert sorted(answer["ranks"]) == [0, 1]
    job.wait(120)

    def both_finished():
        statuses = api(nand_server.http_url, run, "/ranks")["items"]
        return all(s["state"] == "finished" for s in statuses) and statuses

    statuses = wait_for(both_finished, 30, "both ranks to say bye")
    assert [s["step"] for s in statuses] == [answer["step"], answer["step"]], job.output()


def test_a_rank_killed_with_sigkill_is_lost_while_the_others_go_on(nand_server, tmp_path):
    run = "killed"
    env = agent_env(nand_server.zmq_endpoint, run, TOKEN, WORLD_SIZE="2")
    args = ["--no-dist", "--steps", "100000", "--step-time", "0.05", "--policy", "warn"]
    job = launch(
        [sys.executable, *TRAINER, *args],
        env,
        tmp_path / "kill.log",
        copies=2,
        per_copy_env=lambda i: {"RANK": str(i), "LOCAL_RANK": str(i)},
    )
    try:
        statuses = wait_for(ranks_at_step(nand_server.http_url, run, 2, 3), 90, "both ranks")
        victim = next(s for s in statuses if s["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)

        def one_lost():
            by_rank = {s["rank"]: s for s in api(nand_server.http_url, run, "/ranks")["items"]}
            return by_rank[1]["state"] == "lost" and by_rank[0]["state"] == "running" and by_rank

        by_rank = wait_for(one_lost, 30, "rank 1 to be lost")
        step_then = by_rank[0]["step"]

        def rank0_moved_on():
            by_rank = {s["rank"]: s for s in api(nand_server.http_url, run, "/ranks")["items"]}
            return by_rank[0]["step"] > step_then + 5

        wait_for(rank0_moved_on, 30, "rank 0 to go on being reported")
        assert api(nand_server.http_url, run, "/verdict")["state"] == "lost"
    finally:
        job.kill()


def test_the_kubernetes_watchdog_stops_a_diverged_job(nand_server, tmp_path):
    run = "watchdog"
    env = agent_env(nand_server.zmq_endpoint, run, TOKEN, NAND_URL=nand_server.http_url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `nand` on PATH
    train = [*torchrun(2), *TRAINER, "--steps", "100000", "--step-time", "0.05", "--policy", "warn"]
    train += ["--fault", "nan_forward:rank=1:step=5"]
    wrapper = subprocess.run(
        [str(REPO / "examples/kubernetes/nand-watchdog.sh"), *train],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert wrapper.returncode == 3, wrapper.stderr[-3000:]
    assert "diverged" in wrapper.stderr


def run_watchdog(server, run: str, launch_id: str, *trainer: str) -> subprocess.CompletedProcess:
    """One launch of examples/kubernetes/job.yaml: the wrapper around a torchrun job."""
    env = agent_env(server.zmq_endpoint, run, TOKEN, NAND_URL=server.http_url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `nand` on PATH
    env["NAND_LAUNCH"] = launch_id  # the Job's uid, new each time it is applied
    return subprocess.run(
        [str(REPO / "examples/kubernetes/nand-watchdog.sh"), *torchrun(2), *TRAINER, *trainer],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_reapplied_job_is_a_new_attempt_the_watchdog_lets_run(nand_server, tmp_path):
    run = "reapplied"  # the Job's name: the same both times
    fault = ["--steps", "100000", "--step-time", "0.05", "--policy", "warn"]
    first = run_watchdog(nand_server, run, "uid-1", *fault, "--fault", "nan_forward:rank=1:step=5")
    assert first.returncode == 3, first.stderr[-3000:]

    second = run_watchdog(nand_server, run, "uid-2", "--steps", "30", "--policy", "warn")
    assert second.returncode == 0, second.stderr[-3000:]  # not killed on attempt 1's verdict
    verdict = wait_for(
        lambda: (v := api(nand_server.http_url, run, "/verdict"))["state"] == "finished" and v
    )
    assert (verdict["attempt"], verdict["launch"]) == (2, "uid-2")
    old = request_json(run_url(nand_server.http_url, run, "/verdict") + "?attempt=1")
    assert (old["state"], old["origin"]["rank"], old["launch"]) == ("diverged", 1, "uid-1")


def test_the_demo_command_prints_the_verdict_of_its_planted_fault(tmp_path):
    options = ["--no-wait", "--ranks", "2", "--steps", "24", "--step-time", "0"]
    demo = subprocess.run(
        [sys.executable, "-m", "nand", "demo", *options, "--fault", "overflow:rank=1:step=16"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "rank 1 produced" in demo.stdout and "blocks.1.mlp.fc2" in demo.stdout, demo.stdout
    assert "step 16" in demo.stdout and "dashboard" in demo.stdout
    # The replay names the planted overflow's own line: the demo's model is a
    # user's code, not nand's (it was "an unknown line").
    overflow = inspect.getsourcelines(demo_faults._overflow_hook)
    line = next(i for i, text in enumerate(overflow[0]) if "return output +" in text)
    where = f"{inspect.getsourcefile(demo_faults)}:{overflow[1] + line}"
    assert where in " ".join(demo.stdout.split()), demo.stdout
