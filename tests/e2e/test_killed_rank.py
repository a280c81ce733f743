"""A rank killed with SIGKILL in a real 2-rank DDP job (gloo, separate processes,
as a scheduler's OOM killer or a lost node leaves them): the survivor raises
from the dead collective after the process group's timeout, and the verdict
names the killed rank first (``lost``) and the survivor's exception as its
consequence, not the other way round. The job writes down who died and who
raised, when (tests/e2e/killed_job.py): the ground truth, without nand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nand import exitcodes
from nand.testing import free_port
from tests.e2e.conftest import TOKEN, embedded_test_server
from tests.e2e.jobs import Job, agent_env, api, launch, wait_for

pytestmark = pytest.mark.slow

GLOO_TIMEOUT_S = 5.0
KILL_STEP = 5


def start_job(server, tmp_path: Path, run: str, kill_at: str, **extra: str) -> Job:
    env = agent_env(server.zmq_endpoint, run, TOKEN, WORLD_SIZE="2", **extra)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OUT=str(tmp_path),
        KILL_RANK="1",
        KILL_STEP=str(KILL_STEP),
        KILL_AT=kill_at,
        GLOO_TIMEOUT_S=str(GLOO_TIMEOUT_S),
    )
    return launch(
        [sys.executable, "-m", "tests.e2e.killed_job"],
        env,
        tmp_path / f"{run}.log",
        copies=2,
        per_copy_env=lambda i: {"RANK": str(i), "LOCAL_RANK": str(i)},
    )


def nand(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nand", *args], capture_output=True, text=True, timeout=60
    )


def ground_truth(tmp_path: Path) -> dict[int, dict]:
    return {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)}


def settled(server, run: str) -> dict:
    """The verdict once the killed rank reads lost and the survivor has said bye."""

    def both_known():
        states = {s["rank"]: s["state"] for s in api(server.http_url, run, "/ranks")["items"]}
        return states == {0: "crashed", 1: "lost"} and api(server.http_url, run, "/verdict")

    return wait_for(both_known, 30, f"rank 1 of {run} lost and rank 0 crashed")


def test_a_rank_killed_with_sigkill_is_named_first_and_the_survivors_exception_after_it(
    tmp_path,
):
    with embedded_test_server(tmp_path, lost_after_s=3.0) as server:
        job = start_job(server, tmp_path, "sigkill", "start")
        codes = job.wait(120)
        truth = ground_truth(tmp_path)
        assert truth[1].get("killed") and truth[1]["step"] == KILL_STEP, job.output()
        assert codes[1] == -9 and codes[0] != 0 and truth[0]["raised"], job.output()
        verdict = settled(server, "sigkill")
        printed = nand("verdict", "sigkill", "--url", server.http_url)
        waited = nand("wait", "sigkill", "--url", server.http_url, "--timeout", "30")
    assert printed.stdout.startswith("sigkill: lost\nrank 1 lost"), printed.stdout + printed.stderr
    assert waited.returncode == exitcodes.LOST, waited.stdout + waited.stderr
    assert verdict["state"] == "lost", verdict["summary"]
    lost, crashed = verdict["failures"]
    assert (lost["state"], lost["ranks"]) == ("lost", [1])
    assert lost["step"] <= KILL_STEP  # the last step its heartbeats reported
    assert (crashed["state"], crashed["ranks"], crashed["step"]) == ("crashed", [0], KILL_STEP)
    assert crashed["exception"] == truth[0]["raised"]
    assert lost["at"] <= crashed["at"]
    text = verdict["summary"]
    assert text.startswith("rank 1 lost"), text
    assert "Then, as a consequence: rank 0 crashed" in text, text
    assert f"left with an exception: {truth[0]['raised']}" in text, text


def test_a_killed_rank_under_the_stop_policy_with_fingerprints_is_lost_and_no_rank_hangs(
    tmp_path,
):
    """The crossing: ``on_nonfinite="stop"`` (an agreed flag all-reduced at every
    step boundary), replica fingerprints every step, and rank 1 killed between
    its backward and its optimizer step, so the survivor's next collective is
    nand's own. Every value stayed finite and the replicas agreed while both
    lived: the kill came first, so the run is ``lost`` (not ``crashed``, not
    ``replica_mismatch``), and the survivor raises within a bound instead of
    waiting for ever."""
    with embedded_test_server(tmp_path, lost_after_s=3.0) as server:
        extra = {"NAND_FINGERPRINT_STEPS": "1"}
        job = start_job(server, tmp_path, "crossing", "after_backward", POLICY="stop", **extra)
        codes = job.wait(120)
        truth = ground_truth(tmp_path)
        assert truth[1].get("killed") and codes[1] == -9, job.output()
        assert codes[0] != 0 and truth[0]["raised"], job.output()
        # Two collectives may each wait out the timeout: nand's agreed flag, then DDP's.
        assert truth[0]["time"] - truth[1]["time"] < 2 * GLOO_TIMEOUT_S + 10, job.output()
        # nand's own collective met the dead peer first: said as that, not as nand's bug.
        assert "nand: another rank is gone" in job.output(), job.output()
        assert "nand: internal error" not in job.output(), job.output()
        verdict = settled(server, "crossing")
    assert verdict["state"] == "lost", verdict["summary"]
    assert [(f["state"], f["ranks"]) for f in verdict["failures"]] == [
        ("lost", [1]),
        ("crashed", [0]),
    ]
    assert verdict["origin"] is None  # nothing went non-finite
    assert verdict["replica"] is not None and verdict["replica"]["state"] == "consistent"
    assert 0 < verdict["replica"]["last_good_step"] <= KILL_STEP  # compared while both lived
    assert verdict["summary"].startswith("rank 1 lost"), verdict["summary"]
