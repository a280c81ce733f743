"""``ZeroRedundancyOptimizer`` + DDP on 2 gloo processes, reporting to a real
server: the rank whose shard's update made a parameter non-finite produced
it; the other received it through ZeRO's parameter broadcast. One job runs
every scenario (``tests/e2e/zero_job.py``), each first without nand: that
run's hooks on the shard's local optimizer are the ground truth.

    python -m pytest tests/e2e/test_zero_optimizer.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from nand.events import VIA_ZERO_BROADCAST
from nand.testing import free_port
from tests.e2e import zero_job
from tests.e2e.conftest import embedded_test_server
from tests.e2e.jobs import settled_verdict
from tests.e2e.zero_job import PLANTED_RANK, PLANTED_STEP, WORLD

pytestmark = pytest.mark.slow

Results = dict[tuple[str, int], dict[str, Any]]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Results, str]]:
    """The job's results per (run, rank), and the server's HTTP address."""
    folder: Path = tmp_path_factory.mktemp("zero")
    with embedded_test_server(folder) as server, mp.Manager() as manager:
        results = manager.dict()
        args = (free_port(), server.zmq_endpoint, results)
        mp.spawn(zero_job.rank_main, args=args, nprocs=WORLD, join=True)
        yield dict(results), server.http_url


def _first(found: dict[str, Any] | None) -> tuple[Any, ...] | None:
    if found is None:
        return None
    return tuple(found[k] for k in ("phase", "module", "step", "micro_step", "cause"))


def _verdict(job: tuple[Results, str], run: str) -> dict[str, Any]:
    return settled_verdict(job[1], run, WORLD)


def test_the_rank_whose_shard_update_made_the_parameter_inf_produced_it_the_other_received_it(
    job,
):
    results, _ = job
    made = results[("zero-lr", PLANTED_RANK)]["plain"]["made"]
    other = results[("zero-lr", 0)]["plain"]
    # Ground truth: rank 1's own update (lr = inf) made its shard non-finite;
    # rank 0's own update was finite, and its copy went non-finite in step().
    assert made[PLANTED_STEP] and not other["made"][PLANTED_STEP]
    param = made[PLANTED_STEP][0]  # the first, in the optimizer's (the model's) order
    assert param in other["after"][PLANTED_STEP]
    assert other["owner"][param] == PLANTED_RANK
    produced = results[("zero-lr", PLANTED_RANK)]["nand"]["first"]
    received = results[("zero-lr", 0)]["nand"]["first"]
    assert _first(produced) == ("param", param, PLANTED_STEP, 0, "produced")
    assert _first(received) == ("param", param, PLANTED_STEP, 0, "received")
    assert received["via"] == VIA_ZERO_BROADCAST and produced["via"] == ""

    verdict = _verdict(job, "zero-lr")
    origin = verdict["origin"]
    assert (origin["rank"], origin["module"], origin["step"], origin["phase"]) == (
        PLANTED_RANK,
        param,
        PLANTED_STEP,
        "param",
    )
    assert origin["cause"] == "produced" and not verdict["simultaneous"]
    assert verdict["ranks_received"] == [0], verdict["summary"]
    assert f"rank {PLANTED_RANK} produced" in verdict["summary"]
    assert f"rank 0 received it through {VIA_ZERO_BROADCAST}" in verdict["summary"]


def test_every_rank_making_its_own_shard_non_finite_at_one_update_is_simultaneous(job):
    results, _ = job
    firsts = {}
    for rank in range(WORLD):
        made = results[("zero-lr-all", rank)]["plain"]["made"][PLANTED_STEP]
        assert made  # ground truth: each rank's own update made its shard non-finite
        firsts[rank] = _first(results[("zero-lr-all", rank)]["nand"]["first"])
        assert firsts[rank] == ("param", made[0], PLANTED_STEP, 0, "produced")
    verdict = _verdict(job, "zero-lr-all")
    assert verdict["simultaneous"] and verdict["ranks_received"] == [], verdict["summary"]


def test_a_nan_in_one_ranks_optimizer_state_is_its_finding_and_the_parameter_it_makes_is_received(
    job,
):
    results, _ = job
    truth_1 = results[("zero-state", PLANTED_RANK)]["plain"]
    truth_0 = results[("zero-state", 0)]["plain"]
    # Ground truth: the state of rank 1's first own parameter was NaN before
    # the next update, which made that parameter NaN there; rank 0's update
    # of its own shard was finite, and it got the parameter in step().
    state_bad = truth_1["state_bad"][PLANTED_STEP + 1]
    assert state_bad and not truth_1["state_bad"][PLANTED_STEP]
    param = state_bad[0]
    assert truth_1["made"][PLANTED_STEP + 1][0] == param
    assert not truth_0["made"][PLANTED_STEP + 1] and truth_0["after"][PLANTED_STEP + 1][0] == param
    produced = results[("zero-state", PLANTED_RANK)]["nand"]["first"]
    received = results[("zero-state", 0)]["nand"]["first"]
    # (labelled with the update that left the state behind)
    assert _first(produced) == (
        "optimizer_state",
        f"{param}:exp_avg_sq",
        PLANTED_STEP,
        0,
        "produced",
    )
    assert _first(received) == ("param", param, PLANTED_STEP + 1, 0, "received")
    assert received["via"] == VIA_ZERO_BROADCAST

    verdict = _verdict(job, "zero-state")
    origin = verdict["origin"]
    assert (origin["rank"], origin["phase"], origin["step"]) == (
        PLANTED_RANK,
        "optimizer_state",
        PLANTED_STEP,
    )
    assert verdict["ranks_received"] == [0] and not verdict["simultaneous"]
    assert f"rank 0 received it through {VIA_ZERO_BROADCAST}" in verdict["summary"]


def test_a_healthy_zero_run_is_silent_and_its_losses_are_bit_identical_to_the_run_without_nand(
    job,
):
    results, _ = job
    for rank in range(WORLD):
        run = results[("zero-healthy", rank)]
        assert run["nand"]["first"] is None
        assert run["nand"]["losses"] == run["plain"]["losses"]
        assert all(run["nand"]["updated"]) and run["nand"]["finite_at_end"]
    verdict = _verdict(job, "zero-healthy")
    assert verdict["state"] == "finished" and verdict["origin"] is None


def test_skip_skips_the_update_of_every_ranks_shard_so_no_rank_receives_the_bad_one(job):
    results, _ = job
    # Without nand the NaN state reached every rank's parameters.
    assert not any(results[("zero-skip", r)]["plain"]["finite_at_end"] for r in range(WORLD))
    skipped_from = PLANTED_STEP + 1  # the first boundary that reads the bad state
    for rank in range(WORLD):
        run = results[("zero-skip", rank)]["nand"]
        assert run["outcome"] == "finished" and run["finite_at_end"]
        # Every rank skipped its own shard's update from that step on (nothing
        # changed: the broadcast carried the shards as they were).
        expected = [True] * skipped_from + [False] * (zero_job.STEPS - skipped_from)
        assert run["updated"] == expected, rank
    assert _first(results[("zero-skip", PLANTED_RANK)]["nand"]["first"])[0] == "optimizer_state"


def test_stop_stops_every_rank_at_the_same_step_the_receiver_with_stop_requested(job):
    results, _ = job
    producer = results[("zero-stop", PLANTED_RANK)]["nand"]
    receiver = results[("zero-stop", 0)]["nand"]
    assert producer["outcome"] == f"NonFiniteError@{PLANTED_STEP}"
    assert receiver["outcome"] == f"StopRequested@{PLANTED_STEP + 1}"
    # Both left at the boundary of the next step, before its update (and its
    # broadcast): none waits for the other.
    assert producer["left_at"] == receiver["left_at"] == PLANTED_STEP + 1
    assert _first(receiver["first"])[4] == "received"
    assert receiver["first"]["via"] == VIA_ZERO_BROADCAST
