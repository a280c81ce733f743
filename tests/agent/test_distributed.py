"""With torch.distributed up, skip/stop are agreed by all ranks (gloo, 2 processes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nand
from nand.testing import free_port
from tests.agent.models import mlp


def _rank_main(rank: int, port: int, policy: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NAND_RUN="dist-test")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    outcome = "finished"
    dropped = []  # steps whose gradients nand dropped (skip)
    with nand.watch(model, opt, on_nonfinite=policy, log_events=False) as w:
        try:
            for step in range(5):
                x = torch.randn(4, 8)
                if rank == 1 and step == 2:
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                opt.step()
                if model[0].weight.grad is None:
                    dropped.append(step)
                opt.zero_grad()
        except nand.NonFiniteError as exc:
            outcome = f"NonFiniteError@{exc.event.step}"
        except nand.StopRequested as exc:
            outcome = f"StopRequested@{exc.step}"
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    results[rank] = (outcome, w.step, finite, w.first.step if w.first else None, dropped)
    dist.destroy_process_group()


def _run(policy: str) -> dict:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(free_port(), policy, results), nprocs=2, join=True)
    return dict(results)


@pytest.mark.slow
def test_stop_makes_every_rank_stop_at_the_same_step():
    results = _run("stop")
    assert results[1] == ("NonFiniteError@2", 2, True, 2, [])
    assert results[0] == ("StopRequested@2", 2, True, None, [])


@pytest.mark.slow
def test_skip_makes_every_rank_drop_the_same_step():
    results = _run("skip")
    assert results[1] == ("finished", 5, True, 2, [2])
    assert results[0] == ("finished", 5, True, None, [2])  # rank 0 was fine, and skipped too


def _rank_skips_on_device(rank: int, port: int, results: dict) -> None:
    """Deferred ``skip`` with a fused optimizer: the agreed flag stays on the
    device and becomes ``found_inf``; the rank that saw nothing skips too."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NAND_RUN="dist-deferred")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    unchanged = []  # steps whose update left the weights as they were
    with nand.watch(model, opt, on_nonfinite="skip", read="deferred", log_events=False) as w:
        for step in range(5):
            x = torch.randn(4, 8)
            if rank == 1 and step == 2:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            if all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)):
                unchanged.append(step)
            opt.zero_grad()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    results[rank] = (w.deferred, w.step, finite, w.first.step if w.first else None, unchanged)
    dist.destroy_process_group()


@pytest.mark.slow
def test_deferred_skip_makes_every_rank_skip_the_same_step_on_the_device():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_skips_on_device, args=(free_port(), results), nprocs=2, join=True)
    assert results[1] == (True, 5, True, 2, [2])
    assert results[0] == (True, 5, True, None, [2])
