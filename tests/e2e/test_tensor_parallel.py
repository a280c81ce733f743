"""Tensor parallelism (issue 33): a value made non-finite on one rank reaches
the other through a tensor-parallel reduction, and nand says which rank made
it and which received it. Two real processes (gloo, CPU), a small model whose
MLP is split with ``parallelize_module`` (column-parallel fc1, row-parallel
fc2), 2 micro-steps per step, a real embedded nand server. Each faulty job
runs twice in the same processes: without nand, where plain hooks record the
ground truth (``tensor_parallel_job.Truth``), then with nand."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nand.events import VIA_FSDP_ALL_GATHER, VIA_TP_ALL_REDUCE, VIA_TP_GRAD_ALL_REDUCE
from nand.testing import free_port
from tests.e2e.conftest import TOKEN, embedded_test_server
from tests.e2e.jobs import settled_verdict
from tests.e2e.tensor_parallel_job import (
    ACCUM,
    BAD_MICRO,
    BAD_RANK,
    BAD_STEP,
    STEPS,
    WORLD,
    Clock,
    Truth,
    batch,
    finite,
    fsdp_tensor_parallel_net,
    local,
    plant,
    tensor_parallel_net,
)

pytestmark = pytest.mark.slow

#: run: (fault, policy)
RUNS = {
    "tp-forward": ("forward", "warn"),
    "tp-param": ("param", "warn"),
    "tp-backward": ("backward", "warn"),
    "tp-healthy": ("", "warn"),
    "tp-skip": ("forward", "skip"),
    "tp-stop": ("forward", "stop"),
}


def _train(run: str, rank: int, with_nand: bool) -> dict[str, Any]:
    """One job: STEPS steps of ACCUM micro-steps; what happened on this rank."""
    import nand

    fault, policy = RUNS[run]
    model = tensor_parallel_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clock = Clock()
    plant(fault, model, opt, rank, clock)
    truth = None if with_nand else Truth(model, opt, clock)
    result: dict[str, Any] = {"losses": [], "updated": [], "outcome": "finished"}
    watch = (
        nand.watch(model, opt, run=run, on_nonfinite=policy, log_events=False)
        if with_nand
        else None
    )
    try:
        for clock.step in range(STEPS):
            before = [local(p).clone() for p in model.parameters()]
            for clock.micro in range(ACCUM):
                if truth is not None:
                    truth.new_micro_step()
                loss = model(batch(clock.step, clock.micro)).pow(2).mean()
                (loss / ACCUM).backward()
                result["losses"].append(loss.item())
            opt.step()
            opt.zero_grad()
            result["updated"].append(
                any(
                    not torch.equal(a, local(b))
                    for a, b in zip(before, model.parameters(), strict=True)
                )
            )
    except (nand.NonFiniteError, nand.StopRequested) as exc:
        at = exc.event.step if isinstance(exc, nand.NonFiniteError) else exc.step
        result["outcome"] = f"{type(exc).__name__}@{at}"
    finally:
        if watch is not None:
            watch.close()
    result["finite_after"] = all(finite(p) for p in model.parameters())
    if truth is not None:
        result["truth"] = truth.first
    if watch is not None and watch.first is not None:
        f = watch.first
        result["first"] = (f.step, f.micro_step, f.phase, f.module, f.cause)
        result["via"] = f.via
    return result


def _rank_main(rank: int, port: int, endpoint: str, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        NAND_SERVER=endpoint,
        NAND_TOKEN=TOKEN,
        NAND_HEARTBEAT_S="0.5",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    for run in RUNS:
        without = _train(run, rank, with_nand=False)
        results[(run, rank)] = (without, _train(run, rank, with_nand=True))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every run's results per rank (without nand, with nand) and its verdict."""
    with embedded_test_server(tmp_path_factory.mktemp("tp")) as server:
        results = mp.Manager().dict()
        mp.spawn(_rank_main, args=(free_port(), server.zmq_endpoint, results), nprocs=WORLD)
        verdicts = {run: settled_verdict(server.http_url, run, WORLD) for run in RUNS}
        yield {"results": dict(results), "verdicts": verdicts}


def _ranks(jobs: dict[str, Any], run: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [jobs["results"][(run, rank)] for rank in range(WORLD)]


def _assert_origin_and_receiver(jobs, run, origin, received, via) -> None:
    """Ground truth first, then nand's ``watch.first`` on each rank and the verdict."""
    (truth_0, nand_0), (truth_1, nand_1) = _ranks(jobs, run)
    # Without nand: rank 1 made it (its own part non-finite); rank 0 first
    # held it where the reduction brought it, its own part finite.
    assert truth_1["truth"] == (*origin, False)
    assert truth_0["truth"] == (*received, True)
    assert (nand_1["first"], nand_1["via"]) == ((*origin, "produced"), "")
    assert (nand_0["first"], nand_0["via"]) == ((*received, "received"), via)
    verdict = jobs["verdicts"][run]
    head = verdict["origin"]
    assert (head["rank"], head["step"], head["micro_step"], head["phase"], head["module"]) == (
        BAD_RANK,
        *origin,
    ), verdict["summary"]
    assert verdict["ranks_received"] == [0], verdict["summary"]
    assert f"rank 0 received it through {via}" in verdict["summary"]


def test_an_inf_made_in_a_column_parallel_layer_is_received_in_the_row_parallel_all_reduce(
    jobs,
):
    origin = (BAD_STEP, BAD_MICRO, "forward", "mlp.fc1")
    received = (BAD_STEP, BAD_MICRO, "forward", "mlp.fc2")
    _assert_origin_and_receiver(jobs, "tp-forward", origin, received, VIA_TP_ALL_REDUCE)


def test_a_nan_written_into_one_ranks_weight_shard_is_received_by_the_other_at_the_next_forward(
    jobs,
):
    origin = (BAD_STEP, ACCUM - 1, "param", "mlp.fc1.weight")
    received = (BAD_STEP + 1, 0, "forward", "mlp.fc2")
    _assert_origin_and_receiver(jobs, "tp-param", origin, received, VIA_TP_ALL_REDUCE)


def test_an_inf_gradient_made_on_one_rank_is_received_in_the_input_gradients_all_reduce(
    jobs,
):
    origin = (BAD_STEP, BAD_MICRO, "backward", "mlp.fc2")
    received = (BAD_STEP, BAD_MICRO, "backward", "mlp.fc1")
    _assert_origin_and_receiver(jobs, "tp-backward", origin, received, VIA_TP_GRAD_ALL_REDUCE)


def test_a_healthy_tensor_parallel_run_is_silent_and_its_losses_are_bit_identical_without_nand(
    jobs,
):
    for without, with_nand in _ranks(jobs, "tp-healthy"):
        assert "first" not in with_nand and without["truth"] is None
        assert with_nand["losses"] == without["losses"]  # (exact floats: bit for bit)
        assert len(with_nand["losses"]) == STEPS * ACCUM
    assert jobs["verdicts"]["tp-healthy"]["state"] == "finished"


def test_skip_drops_the_same_step_on_every_rank_and_training_goes_on_finite(jobs):
    expected = [step != BAD_STEP for step in range(STEPS)]
    for without, with_nand in _ranks(jobs, "tp-skip"):
        assert without["updated"] == [True] * STEPS  # (without nand every step updates)
        assert with_nand["updated"] == expected and with_nand["finite_after"]
        assert with_nand["outcome"] == "finished"


def test_stop_stops_every_rank_at_the_same_step(jobs):
    outcomes = {with_nand["outcome"] for _, with_nand in _ranks(jobs, "tp-stop")}
    assert {o.split("@")[1] for o in outcomes} == {str(BAD_STEP)}, outcomes


# --- FSDP2 x tensor parallelism on a 2 x 2 mesh -----------------------------


def _train_2d(rank: int, with_nand: bool) -> dict[str, Any]:
    """NaN written into rank 1's shard of mlp.fc1.weight after step 2's update;
    each data-parallel pair (ranks 0-1, 2-3) its own batches."""
    import nand

    model = fsdp_tensor_parallel_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clock = Clock()
    plant("param", model, opt, rank, clock)
    truth = None if with_nand else Truth(model, opt, clock)
    watch = nand.watch(model, opt, run="fsdp-tp", log_events=False) if with_nand else None
    own_finite = []  # this rank's own shards after each update (ground truth)
    for clock.step in range(STEPS):
        if truth is not None:
            truth.new_micro_step()
        model(batch(clock.step, rank // 2)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        own_finite.append(all(finite(p) for p in model.parameters()))
    if watch is None:
        assert truth is not None
        return {"truth": truth.first, "own_finite": own_finite}
    watch.close()
    f = watch.first
    assert f is not None
    return {"first": (f.step, f.micro_step, f.phase, f.module, f.cause), "via": f.via}


def _rank_main_2d(rank: int, port: int, endpoint: str, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        NAND_SERVER=endpoint,
        NAND_TOKEN=TOKEN,
        NAND_HEARTBEAT_S="0.5",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    results[rank] = (_train_2d(rank, with_nand=False), _train_2d(rank, with_nand=True))
    dist.destroy_process_group()


def test_fsdp2_with_tensor_parallelism_names_the_shards_owner_and_three_receivers_by_collective(
    tmp_path,
):
    with embedded_test_server(tmp_path) as server:
        results = mp.Manager().dict()
        mp.spawn(_rank_main_2d, args=(free_port(), server.zmq_endpoint, results), nprocs=4)
        verdict = settled_verdict(server.http_url, "fsdp-tp", 4)
    truth = {rank: without for rank, (without, _) in results.items()}
    found = {
        rank: (with_nand["first"], with_nand["via"]) for rank, (_, with_nand) in results.items()
    }
    # Without nand: only rank 1's own shard went bad; rank 3 (its FSDP peer)
    # first held it in fc1's forward (the weight all-gathered), ranks 0 and 2
    # in fc2's, their own partial results finite.
    assert [truth[r]["own_finite"][BAD_STEP] for r in range(4)] == [True, False, True, True]
    assert truth[1]["truth"] == (BAD_STEP, 0, "param", "mlp.fc1.weight", False)
    assert truth[3]["truth"] == (BAD_STEP + 1, 0, "forward", "mlp.fc1", False)
    assert truth[0]["truth"] == truth[2]["truth"] == (BAD_STEP + 1, 0, "forward", "mlp.fc2", True)
    assert found == {
        1: ((BAD_STEP, 0, "param", "mlp.fc1.weight", "produced"), ""),
        3: ((BAD_STEP + 1, 0, "forward", "mlp.fc1", "received"), VIA_FSDP_ALL_GATHER),
        0: ((BAD_STEP + 1, 0, "forward", "mlp.fc2", "received"), VIA_TP_ALL_REDUCE),
        2: ((BAD_STEP + 1, 0, "forward", "mlp.fc2", "received"), VIA_TP_ALL_REDUCE),
    }
    assert (verdict["origin"]["rank"], verdict["ranks_received"]) == (1, [0, 2, 3])
    summary = verdict["summary"]
    assert f"ranks 0, 2 received it through {VIA_TP_ALL_REDUCE}" in summary, summary
    assert f"rank 3 received it through {VIA_FSDP_ALL_GATHER}" in summary, summary
