"""Ground truth: a fault planted on rank r, module m, step s, phase p of a real
torchrun job (gloo, CPU) → the server's verdict names exactly that."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nand.events import VIA_FSDP_ALL_GATHER
from tests.e2e.conftest import TOKEN
from tests.e2e.jobs import TRAINER, agent_env, api, launch, settled_verdict, torchrun

pytestmark = pytest.mark.slow


def run_job(server, tmp_path, run: str, nproc: int, *args: str) -> tuple[list[int], dict]:
    env = agent_env(server.zmq_endpoint, run, TOKEN)
    job = launch([*torchrun(nproc), *TRAINER, *args], env, tmp_path / f"{run}.log")
    codes = job.wait()
    verdict = settled_verdict(server.http_url, run, nproc)
    return codes, verdict


def assert_origin(verdict: dict, rank: int, module: str, step: int, phase: str) -> None:
    origin = verdict["origin"]
    assert verdict["state"] == "diverged", verdict
    got = (origin["rank"], origin["module"], origin["step"], origin["phase"])
    assert got == (rank, module, step, phase), verdict["summary"]


@pytest.mark.nand_mode("full")  # (the "overflow" hint reads the per-layer history: full mode only)
def test_forward_overflow_on_one_rank_names_that_rank_layer_and_step(nand_server, tmp_path):
    codes, verdict = run_job(
        nand_server, tmp_path, "overflow", 2, "--steps", "16", "--fault", "overflow:rank=1:step=12"
    )
    assert_origin(verdict, rank=1, module="blocks.1.mlp.fc2", step=12, phase="forward")
    assert verdict["origin"]["cause"] == "produced"
    assert verdict["ranks_received"] == [0] and not verdict["simultaneous"]
    assert verdict["hint"] == "overflow", verdict
    assert codes != [0]  # every rank stopped itself (on_nonfinite="raise")


def test_backward_only_nan_is_blamed_on_the_module_whose_backward_made_it(nand_server, tmp_path):
    fault = "nan_backward:rank=0:step=5:module=blocks.0.mlp.fc1"
    _, verdict = run_job(nand_server, tmp_path, "backward", 2, "--steps", "8", "--fault", fault)
    assert_origin(verdict, rank=0, module="blocks.0.mlp.fc1", step=5, phase="backward")
    assert verdict["ranks_received"] == [1]


def test_bad_data_on_one_rank_is_reported_as_input_data(nand_server, tmp_path):
    args = ("--model", "mlp", "--steps", "8", "--fault", "bad_data:rank=1:step=4")
    _, verdict = run_job(nand_server, tmp_path, "bad-data", 2, *args)
    assert_origin(verdict, rank=1, module="", step=4, phase="input")
    assert verdict["origin"]["cause"] == "data" and verdict["hint"] == "input_data"
    assert verdict["ranks_received"] == [0]


def test_learning_rate_explosion_on_all_ranks_is_simultaneous_not_one_rank(nand_server, tmp_path):
    args = ("--model", "mlp", "--steps", "10", "--fault", "lr_explosion:step=6")
    _, verdict = run_job(nand_server, tmp_path, "lr-explosion", 4, *args)
    assert verdict["state"] == "diverged"
    assert verdict["origin"]["step"] == 6 and verdict["origin"]["phase"] == "param"
    assert verdict["simultaneous"] and verdict["ranks_affected"] == [0, 1, 2, 3]
    assert verdict["ranks_received"] == []


def test_fsdp_shard_made_non_finite_by_one_rank_names_its_owner(nand_server, tmp_path):
    args = (
        "--fsdp",
        "--model",
        "mlp",
        "--steps",
        "10",
        "--fault",
        "bad_shard:rank=1:step=5:module=2",
    )
    _, verdict = run_job(nand_server, tmp_path, "fsdp-shard", 2, *args)
    assert_origin(verdict, rank=1, module="2.weight", step=5, phase="param")
    assert verdict["ranks_received"] == [0]
    # Rank 0's own event agrees (its log line, read without a server, too).
    received = api(nand_server.http_url, "fsdp-shard", "/events?rank=0")["items"][0]
    assert (received["phase"], received["cause"]) == ("forward", "received")
    assert received["via"] == VIA_FSDP_ALL_GATHER
    assert f"rank 0 received it through {VIA_FSDP_ALL_GATHER}" in verdict["summary"]


def test_nand_wait_exits_with_the_diverged_code(nand_server, tmp_path):
    run = "waited"
    env = agent_env(nand_server.zmq_endpoint, run, TOKEN)
    wait = [sys.executable, "-m", "nand", "wait", run, "--url", nand_server.http_url]
    until_diverged = subprocess.Popen([*wait, "--until", "diverged", "--timeout", "120"])
    until_finished = subprocess.Popen([*wait, "--until", "finished", "--timeout", "120"])
    job = launch(
        [*torchrun(2), *TRAINER, "--steps", "12", "--fault", "nan_forward:rank=0:step=6"],
        env,
        tmp_path / "waited.log",
    )
    job.wait()
    assert until_diverged.wait(60) == 0
    assert until_finished.wait(60) == 3  # nand wait's "diverged" exit code
