"""examples/slurm/train_cpu.sbatch submitted to a real one-node Slurm (tests/e2e/slurm.py),
as a user submits it: two tasks, ``srun`` + ``torchrun`` + gloo, the demo trainer
reporting to a real nand server, ``nand watchdog`` in front of the step.

What is checked comes from Slurm and the machine, not from nand: the job's
final state (``scontrol``, the ``jobcomp/filetxt`` log), its restart count, and
the processes left on the node (every process whose environment carries the
job's ``SLURM_JOB_ID``). The planted fault is the ground truth of the verdict."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import time_to_cancel
from nand import exitcodes
from nand.server.embedded import EmbeddedServer
from tests.e2e import slurm
from tests.e2e.conftest import TOKEN, embedded_test_server
from tests.e2e.jobs import api, wait_for

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples/slurm/train_cpu.sbatch"
BIN = Path(sys.executable).parent  # nand, torchrun
#: The planted fault: rank 1's blocks.1.mlp.fc2 overflows to +inf in forward at step 40.
FAULT_RANK, FAULT_MODULE, FAULT_STEP = 1, "blocks.1.mlp.fc2", 40
FAULT = f"overflow:rank={FAULT_RANK}:step={FAULT_STEP}:module={FAULT_MODULE}"
#: A job that would run for minutes unless something ends it.
LONG = ("--steps", "2000", "--step-time", "0.1")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    with embedded_test_server(tmp_path, heartbeat_s=0.5, lost_after_s=3.0) as started:
        yield started


def submit(cluster: slurm.Cluster, server: EmbeddedServer, out: Path, *trainer: str) -> str:
    """sbatch the example with the trainer's options; what a user exports, no NAND_RUN."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "NAND_SERVER": server.zmq_endpoint,
        "NAND_URL": server.http_url,
        "NAND_TOKEN": TOKEN,
        "NAND_HEARTBEAT_S": "0.5",
    }
    return cluster.sbatch(SCRIPT, *trainer, env=env, output=out)


def job_processes(job: str) -> dict[int, str]:
    """The job's processes on this machine (pid: command line), by their environment."""
    found = {}
    for pid in slurm.processes_with_env("SLURM_JOB_ID", job):
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def rank_pid(job: str, rank: int) -> int:
    """The pid of the trainer process of ``rank`` (torchrun's RANK), from /proc."""
    for pid in slurm.processes_with_env("SLURM_JOB_ID", job):
        if pid in slurm.processes_with_env("RANK", str(rank)):
            return pid
    raise AssertionError(f"no process of job {job} has RANK={rank}")


def ended(cluster: slurm.Cluster, job: str, out: Path, timeout: float = 240.0) -> dict:
    """The job's final fields, once Slurm says its processes are gone; then nothing of
    it may be left on the node."""
    try:
        fields = cluster.wait_for_state(job, slurm.FINAL_STATES, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{tail(log_of(out))}\n{cluster.logs()}") from None
    # (Slurm may say so a moment before the last of them is reaped)
    deadline = time.monotonic() + 10.0
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(job) == {}, f"left on the node after the job: {job_processes(job)}"
    return fields


def log_of(out: Path) -> str:
    return out.read_text(errors="replace") if out.exists() else "(no job output)"


def tail(log: str) -> str:
    return log[-5000:]


def reporting(base: str, job: str, step: int, attempt: int = 1) -> None:
    """Wait until both ranks of the job's ``attempt`` reported reaching ``step``."""

    def there() -> bool:
        ranks = api(base, job, f"/ranks?attempt={attempt}")["items"]
        return len(ranks) == 2 and all(r["step"] >= step for r in ranks)

    wait_for(there, 180, f"both ranks of job {job} (attempt {attempt}) at step {step}")


def test_a_diverging_job_is_cancelled_by_its_watchdog_and_nothing_of_it_is_left(
    slurm_cluster, server, tmp_path
):
    out = tmp_path / "job.out"
    job = submit(slurm_cluster, server, out, *LONG, "--fault", FAULT)
    fields = ended(slurm_cluster, job, out)
    log = log_of(out)
    assert fields["JobState"] == "CANCELLED", tail(log)
    [completion] = [c for c in slurm_cluster.completions() if c["JobId"] == job]
    assert completion["JobState"] == "CANCELLED"
    verdict = api(server.http_url, job, "/verdict")
    origin = verdict["origin"]
    assert (verdict["state"], verdict["launch"]) == ("diverged", f"{job}.0"), verdict["summary"]
    assert (origin["rank"], origin["module"], origin["step"], origin["phase"]) == (
        FAULT_RANK,
        FAULT_MODULE,
        FAULT_STEP,
        "forward",
    ), verdict["summary"]
    assert f"cancelling Slurm job {job} (scancel)" in log, tail(log)
    assert verdict["summary"] in log, tail(log)  # the verdict, in the job's own output
    # (benchmarks/time_to_cancel.py reads the watchdog's timed lines from such a log)
    marks = time_to_cancel.watchdog_times(log)
    assert set(marks) == {"t_watchdog", "t_scancel", "t_cancelled"}, tail(log)
    assert marks["t_watchdog"] <= marks["t_scancel"] <= marks["t_cancelled"], tail(log)
    assert api(server.http_url, job)["latest_step"] < 1000, "the job ran on after diverging"


def test_a_healthy_job_completes_untouched_and_its_watchdog_exits_with_it(
    slurm_cluster, server, tmp_path
):
    out = tmp_path / "job.out"
    job = submit(slurm_cluster, server, out, "--steps", "20")
    fields = ended(slurm_cluster, job, out)
    log = log_of(out)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), tail(log)
    assert "cancelling" not in log, tail(log)
    summary = wait_for(
        lambda: (s := api(server.http_url, job))["state"] == "finished" and s, 30, "finished"
    )
    assert (summary["latest_step"], summary["ranks_seen"]) == (20, 2)


def test_a_rank_killed_mid_run_is_lost_and_the_job_ends(slurm_cluster, server, tmp_path):
    out = tmp_path / "job.out"
    job = submit(slurm_cluster, server, out, *LONG)
    reporting(server.http_url, job, 5)
    killed = rank_pid(job, 1)
    os.kill(killed, signal.SIGKILL)
    fields = ended(slurm_cluster, job, out)
    log = log_of(out)
    assert fields["JobState"] == "FAILED", log  # srun --kill-on-bad-exit ended the step
    assert "cancelling" not in log, tail(log)

    def lost() -> dict | None:
        verdict = api(server.http_url, job, "/verdict")
        return verdict if verdict["state"] == "lost" else None

    verdict = wait_for(lost, 30, f"job {job}'s run lost")
    assert FAULT_RANK in verdict["failures"][0]["ranks"], verdict["summary"]
    ranks = {r["rank"]: r for r in api(server.http_url, job, "/ranks")["items"]}
    assert (ranks[1]["state"], ranks[1]["pid"]) == ("lost", killed)


def test_nand_stop_ends_the_job_at_one_step_on_every_rank(slurm_cluster, server, tmp_path):
    out = tmp_path / "job.out"
    job = submit(slurm_cluster, server, out, *LONG)
    reporting(server.http_url, job, 5)
    stop = subprocess.run(
        [BIN / "nand", "stop", job, "--url", server.http_url, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stop.returncode == exitcodes.OK, stop.stderr
    fields = ended(slurm_cluster, job, out)
    log = log_of(out)
    assert fields["JobState"] != "CANCELLED" and "cancelling" not in log, tail(log)
    step = api(server.http_url, job, "/verdict")["stop"]["step"]
    assert f"at step {step} or the next" in stop.stdout
    stopped = [line for line in log.splitlines() if "stopping on request" in line]
    assert sorted(stopped) == [
        f"nand.demo.trainer WARNING rank {rank}: stopping on request at step {step}"
        for rank in (0, 1)
    ], tail(log)
    assert api(server.http_url, job)["latest_step"] < 1000


def test_a_requeued_job_is_a_new_attempt_of_the_same_run(slurm_cluster, server, tmp_path):
    out = tmp_path / "job.out"
    job = submit(slurm_cluster, server, out, "--steps", "60", "--step-time", "0.1")
    reporting(server.http_url, job, 3)
    slurm_cluster.run("scontrol", "requeue", job)
    slurm_cluster.wait_for_state(job, ("PENDING",), 60)
    # A requeued job waits ~2 min (its begin time) before it may start again.
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    fields = ended(slurm_cluster, job, out)
    log = log_of(out)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), tail(log)
    run = wait_for(
        lambda: (s := api(server.http_url, job))["state"] == "finished" and s, 30, "finished"
    )
    assert (run["attempt"], run["launch"], run["latest_step"]) == (2, f"{job}.1", 60)
    first = api(server.http_url, job, "?attempt=1")
    assert (first["launch"], first["live"]) == (f"{job}.0", False)
    assert first["latest_step"] < 60
    assert "cancelling" not in log, tail(log)


def test_slurm_job_processes_are_found_by_their_environment(slurm_cluster, tmp_path):
    """The check the tests rely on ("nothing is left") sees a job's processes."""
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\nsrun sleep 300\n")
    env = {**os.environ}
    done = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path / 'out'}", str(script)],
        capture_output=True,
        text=True,
        env={**env, "SLURM_CONF": str(slurm_cluster.conf)},
        check=True,
    )
    job = done.stdout.strip()
    deadline = time.monotonic() + 60
    while not any("sleep 300" in c for c in job_processes(job).values()):
        assert time.monotonic() < deadline, "the job's sleep never showed"
        time.sleep(0.2)
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_for_state(job, slurm.FINAL_STATES, 60)["JobState"] == "CANCELLED"
    assert job_processes(job) == {}


def test_a_second_cluster_on_the_machine_does_not_meet_the_first(slurm_cluster):
    """Another test session's cluster (its own ports, directory, munge key) runs
    steps beside this one, and stopping it leaves this one working."""
    with slurm.cluster() as other:
        assert other.conf != slurm_cluster.conf
        assert other.run("srun", "--ntasks=2", "echo", "other").split() == ["other", "other"]
        assert slurm_cluster.run("srun", "--ntasks=1", "echo", "this").split() == ["this"]
    assert slurm.processes_with_env("SLURM_CONF", str(other.conf)) == []
    assert slurm_cluster.run("srun", "--ntasks=1", "echo", "still").split() == ["still"]


def test_the_gpu_example_and_the_docs_run_the_step_as_the_tested_example_does():
    """train.sbatch (2 nodes x 8 GPUs, never run here) and the docs' Slurm
    section (docs/schedulers.md, where the README's Slurm line points) launch
    the step the way train_cpu.sbatch, which runs above, does."""

    def launch_line(path: Path) -> str:
        [line] = [w for w in path.read_text().splitlines() if w.startswith("nand watchdog")]
        return line

    tested = launch_line(SCRIPT)
    assert tested.startswith("nand watchdog -- srun --kill-on-bad-exit=1 torchrun")
    assert launch_line(SCRIPT.with_name("train.sbatch")) == tested
    page = (REPO / "docs" / "schedulers.md").read_text()
    assert "nand watchdog -- srun --kill-on-bad-exit=1 torchrun ... train.py" in page
    assert "nand watchdog -- srun" in (REPO / "README.md").read_text()
    for name in ("train.sbatch", "train_cpu.sbatch"):
        text = (SCRIPT.parent / name).read_text()
        assert "NAND_RUN" not in text and "scancel" not in text.replace("(scancel)", "")
