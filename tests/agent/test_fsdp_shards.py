"""FSDP2 all-gathers every rank's parameter shard into every rank's forward: a
shard made non-finite on one rank is that rank's finding, and what the other
ranks see in their forward they *received* (real GPT-2 from transformers,
``fully_shard`` per block, gloo, 2 processes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nand
from nand.testing import free_port
from tests.integrations.zoo import case

pytestmark = pytest.mark.slow

PLANTED_RANK, PLANTED_STEP = 1, 2
PLANTED_PARAM = "transformer.h.0.mlp.c_fc.weight"


def _sharded_gpt2() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = case("gpt2").build(seed=0)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _plant(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, clock: list[int]):
    """After the optimizer step of PLANTED_STEP, +inf in rank 1's own shard (a
    corrupted write, not the optimizer's doing): registered before nand's hooks."""
    weight = model.get_parameter(PLANTED_PARAM)

    def corrupt(*_: object) -> None:
        if rank == PLANTED_RANK and clock[0] == PLANTED_STEP:
            with torch.no_grad():
                _local(weight).view(-1)[0] = float("inf")

    opt.register_step_post_hook(corrupt)


def _rank_main(rank: int, port: int, policy: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NAND_RUN="fsdp-shards")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = _sharded_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clock = [0]
    _plant(model, opt, rank, clock)
    outcome = "finished"
    own_shard_finite = []  # ground truth without nand: this rank's own shards, per step
    with nand.watch(model, opt, on_nonfinite=policy, log_events=False) as w:
        try:
            for step in range(5):
                clock[0] = step
                case("gpt2").loss(model, case("gpt2").batch(step * 2 + rank)).backward()
                opt.step()
                opt.zero_grad()
                own = all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())
                own_shard_finite.append(own)
        except nand.NonFiniteError as exc:
            outcome = f"NonFiniteError@{exc.event.step}"
        except nand.StopRequested as exc:
            outcome = f"StopRequested@{exc.step}"
    first = w.first
    found = (first.phase, first.module, first.step, first.cause) if first else None
    results[rank] = (outcome, found, own_shard_finite)
    dist.destroy_process_group()


def _run(policy: str) -> dict:
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(free_port(), policy, results), nprocs=2, join=True)
    return dict(results)


def test_the_rank_whose_shard_went_bad_produced_it_and_the_other_received_it():
    results = _run("warn")
    _, found_1, own_1 = results[1]
    _, found_0, own_0 = results[0]
    assert own_1[PLANTED_STEP] is False and all(own_0[: PLANTED_STEP + 1])  # the ground truth
    assert found_1 == ("param", PLANTED_PARAM, PLANTED_STEP, "produced")
    # Rank 0's own shards were finite: the first NaN it saw, in the next
    # step's forward of the layer, came through FSDP's all-gather.
    assert found_0 == ("forward", "transformer.h.0.mlp.c_fc", PLANTED_STEP + 1, "received")


def test_stop_raises_stop_requested_on_the_rank_that_only_received_it():
    results = _run("stop")
    assert results[1][0] == f"NonFiniteError@{PLANTED_STEP}"
    assert results[0][0] == f"StopRequested@{PLANTED_STEP + 1}"
    assert results[0][1][3] == "received"
