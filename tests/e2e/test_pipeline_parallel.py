"""Pipeline parallelism (``torch.distributed.pipelining``, 2 stages on 2 gloo
processes, GPipe and 1F1B): the stage that made a non-finite value is the
producer, at the micro-batch the schedule ran; the other stage received it
through the pipeline's send/recv. Ground truth from plain hooks without nand
(``pipeline_job.GroundTruth``), nand's answer from ``watch.first`` on each
rank and from a real server's verdict. One spawn runs every case."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp

from nand.testing import free_port
from tests.e2e.conftest import TOKEN, embedded_test_server
from tests.e2e.jobs import settled_verdict
from tests.e2e.pipeline_job import FAULT_STEP, Run, rank_main

pytestmark = pytest.mark.slow

RUNS = [
    Run("bare", "gpipe", "none", nand=False),
    Run("healthy", "gpipe", "none"),
    Run("healthy-1f1b", "1f1b", "none"),
    Run("bare-1f1b", "1f1b", "none", nand=False),
    *(
        Run(f"{fault}-{schedule}{suffix}", schedule, fault, nand=not suffix)
        for fault in ("overflow", "backward")
        for schedule in ("gpipe", "1f1b")
        for suffix in ("-truth", "")
    ),
    Run("overflow-traced-truth", "gpipe", "overflow", nand=False, traced=True),
    Run("overflow-traced", "gpipe", "overflow", traced=True),
    Run("overflow-interleaved-truth", "interleaved", "overflow", nand=False),
    Run("overflow-interleaved", "interleaved", "overflow"),
    Run("backward-zero-bubble-truth", "zero-bubble", "backward", nand=False),
    Run("backward-zero-bubble", "zero-bubble", "backward"),
    Run("skip", "gpipe", "overflow", policy="skip"),
    Run("stop", "1f1b", "backward", policy="stop"),
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Every run of :data:`RUNS` on 2 ranks, reported to one real server."""
    with embedded_test_server(tmp_path_factory.mktemp("pp-server")) as server:
        prefix = f"pp-{os.getpid()}"
        manager = mp.Manager()
        results = manager.dict()
        args = (free_port(), server.zmq_endpoint, prefix, RUNS, results)
        os.environ["NAND_TOKEN"] = TOKEN  # (read by the spawned ranks)
        try:
            mp.spawn(rank_main, args=args, nprocs=2, join=True)
            results = dict(results)
        finally:
            del os.environ["NAND_TOKEN"]
            manager.shutdown()
        verdicts = {
            run.name: settled_verdict(server.http_url, f"{prefix}-{run.name}", 2)
            for run in RUNS
            if run.nand
        }
        yield results, verdicts


def test_the_healthy_pipeline_is_silent_and_its_losses_are_bit_identical(job):
    results, verdicts = job
    for name, bare in (("healthy", "bare"), ("healthy-1f1b", "bare-1f1b")):
        for rank in (0, 1):
            assert results[(name, rank)]["first"][0] is None
        assert results[(name, 1)]["losses"] == results[(bare, 1)]["losses"]
        assert verdicts[name]["state"] != "diverged", verdicts[name]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "traced"])
def test_an_overflow_in_stage_1_is_its_own_and_stage_0_received_the_gradient(job, schedule):
    results, verdicts = job
    truth = {rank: results[(f"overflow-{schedule}-truth", rank)]["truth"][0] for rank in (0, 1)}
    # The ground truth: stage 1 made it in the forward of micro-batch 2;
    # stage 0 first saw it in that micro-batch's gradient, sent back.
    assert truth[1][:3] == (FAULT_STEP, 2, "forward") and truth[1][4]
    assert truth[0] == (FAULT_STEP, 2, "backward", "", False)
    first = {rank: results[(f"overflow-{schedule}", rank)]["first"][0] for rank in (0, 1)}
    assert _where(first[1]) == (*truth[1][:4], "produced")
    assert _where(first[0]) == (FAULT_STEP, 2, "backward", "", "received")
    assert first[0]["via"] == "the pipeline's send/recv from stage 1"
    verdict = verdicts[f"overflow-{schedule}"]
    _assert_origin(verdict, rank=1, where=truth[1][:4])
    assert verdict["ranks_received"] == [0], verdict["summary"]
    assert "rank 0 received it through the pipeline's send/recv from stage 1" in verdict["summary"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_nan_made_in_stage_0s_backward_reaches_stage_1_only_in_the_next_forward(job, schedule):
    results, verdicts = job
    truth = {rank: results[(f"backward-{schedule}-truth", rank)]["truth"][0] for rank in (0, 1)}
    assert truth[0] == (FAULT_STEP, 1, "backward", "layers.1.act", True)
    assert truth[1] == (FAULT_STEP + 1, 0, "forward", "", False)
    first = {rank: results[(f"backward-{schedule}", rank)]["first"][0] for rank in (0, 1)}
    assert _where(first[0]) == (*truth[0][:4], "produced")
    assert _where(first[1]) == (FAULT_STEP + 1, 0, "forward", "", "received")
    assert first[1]["via"] == "the pipeline's send/recv from stage 0"
    verdict = verdicts[f"backward-{schedule}"]
    _assert_origin(verdict, rank=0, where=truth[0][:4])
    assert verdict["ranks_received"] == [1], verdict["summary"]
    assert "rank 1 received it through the pipeline's send/recv from stage 0" in verdict["summary"]


@pytest.mark.parametrize("case", ["overflow-interleaved", "backward-zero-bubble"])
def test_two_stages_per_rank_name_the_stage_that_made_it_and_the_receivers(job, case):
    """Interleaved 1F1B and zero-bubble: stages 0 and 2 on rank 0, 1 and 3 on
    rank 1 (one layer each, a watch per stage module). Stage 2 overflows in
    micro-batch 2's forward; or stage 1's backward makes a NaN in micro-batch 1,
    which the other stages get through the pipeline (stage 0 in that backward,
    stages 2 and 3 in the next forward)."""
    results, verdicts = job
    truths = {rank: results[(f"{case}-truth", rank)]["truth"] for rank in (0, 1)}
    expected = {
        "overflow-interleaved": (0, 1, (FAULT_STEP, 2, "forward", "layers.2", True)),
        "backward-zero-bubble": (1, 0, (FAULT_STEP, 1, "backward", "layers.1.act", True)),
    }
    origin_rank, stage_there, origin_truth = expected[case]
    assert truths[origin_rank][stage_there] == origin_truth  # the ground truth
    for rank in (0, 1):
        firsts = results[(case, rank)]["first"]
        for i, (truth, first) in enumerate(zip(truths[rank], firsts, strict=True)):
            assert _where(first) == (*truth[:4], "produced" if truth[4] else "received")
            sender = 2 * i + rank + (-1 if first["phase"] == "forward" else 1)
            if not truth[4]:
                assert first["via"] == f"the pipeline's send/recv from stage {sender}"
    verdict = verdicts[case]
    _assert_origin(verdict, rank=origin_rank, where=origin_truth[:4])
    assert verdict["ranks_received"] == [1 - origin_rank], verdict["summary"]


def test_skip_drops_the_same_step_on_every_stage_and_training_goes_on(job):
    results, _ = job
    for rank in (0, 1):
        run = results[("skip", rank)]
        assert run["updated"] == [True, False, True], rank  # step 1 skipped, on both stages
        assert run["outcome"] == "finished" and run["finite_weights"]


def test_stop_ends_every_stage_at_the_same_step(job):
    results, _ = job
    assert results[("stop", 0)]["outcome"] == f"NonFiniteError@{FAULT_STEP}"
    assert results[("stop", 1)]["outcome"] == f"StopRequested@{FAULT_STEP}"
    for rank in (0, 1):  # the update of the stopped step was not applied
        assert results[("stop", rank)]["updated"] == [True, False]


def _where(first: dict | None) -> tuple | None:
    if first is None:
        return None
    return (first["step"], first["micro_step"], first["phase"], first["module"], first["cause"])


def _assert_origin(verdict: dict, rank: int, where: tuple) -> None:
    origin = verdict["origin"]
    assert verdict["state"] == "diverged", verdict
    got = (origin["step"], origin["micro_step"], origin["phase"], origin["module"])
    assert (origin["rank"], got) == (rank, where), verdict["summary"]
    assert origin["cause"] == "produced" and not verdict["simultaneous"], verdict["summary"]
