"""DDP (gloo, 2 real processes): names as written, and the rank that produced a
non-finite gradient told apart from the rank that received it."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import nand
from nand.events import VIA_GRAD_ALL_REDUCE
from tests.agent.models import mlp

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poison_weight_grad(model: torch.nn.Module, at_step: list[int], step: int) -> None:
    """A NaN in one parameter's gradient only: no activation gradient shows it."""
    weight = model[0].weight
    weight.register_hook(lambda g: g * float("nan") if at_step[0] == step else None)


def _rank_main(
    rank: int, port: int, local_check: bool, results: dict, watch_inner: bool = False
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NAND_RUN="ddp-test")
    os.environ["NAND_DDP_LOCAL_CHECK"] = "1" if local_check else "0"
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    inner = mlp()
    step_now = [0]
    if rank == 1:
        _poison_weight_grad(inner, step_now, step=3)
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watched = inner if watch_inner else model  # (HF Trainer's callbacks get the inner one)
    with nand.watch(watched, opt, on_nonfinite="warn", log_events=False) as watch:
        for step in range(5):
            step_now[0] = step
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first = watch.first
    found = (first.step, first.phase, first.module, first.cause, first.via) if first else None
    results[rank] = found
    dist.destroy_process_group()


def _run(local_check: bool, watch_inner: bool = False) -> dict:
    results = mp.Manager().dict()
    args = (_free_port(), local_check, results, watch_inner)
    mp.spawn(_rank_main, args=args, nprocs=2, join=True)
    return dict(results)


def test_the_rank_whose_own_gradient_went_nan_produced_it_and_the_other_received_it():
    results = _run(local_check=True)
    assert results[1] == (3, "grad", "0.weight", "produced", "")  # no "module." prefix
    assert results[0] == (3, "grad", "0.weight", "received", VIA_GRAD_ALL_REDUCE)


def test_without_the_local_check_every_rank_can_only_say_received():
    results = _run(local_check=False)
    assert results[0] == results[1] == (3, "grad", "0.weight", "received", VIA_GRAD_ALL_REDUCE)


def test_a_model_watched_inside_a_ddp_wrapper_it_was_not_given_is_found_at_its_first_call():
    results = _run(local_check=True, watch_inner=True)
    assert results[1] == (3, "grad", "0.weight", "produced", "")
    assert results[0] == (3, "grad", "0.weight", "received", VIA_GRAD_ALL_REDUCE)


def _disabled_rank_main(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NAND_DISABLE="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = nand.watch(model, opt)
    # DDP takes one communication hook: the user's own must still be accepted.
    model.register_comm_hook(None, lambda _, bucket: _allreduce_future(bucket))
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    results[rank] = (watch.step, hooked, bool(opt._optimizer_step_pre_hooks))
    dist.destroy_process_group()


def _allreduce_future(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def test_nand_disable_leaves_ddp_free_for_the_user_s_own_comm_hook():
    results = mp.Manager().dict()
    mp.spawn(_disabled_rank_main, args=(_free_port(), results), nprocs=2, join=True)
    assert dict(results) == {0: (0, False, False), 1: (0, False, False)}
