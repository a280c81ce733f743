"""The read a boundary does when the ranks must agree (``skip``/``stop`` in a
process group: ``Boundary._read_agreed``, and read one step late ``_put`` and
``take``): the step's "anything non-finite" flag is all-reduced and rides in
the step's one read. The multi-rank tests (torchrun, gloo, minutes each) run
it with other ranks; here a one-rank gloo group in this process runs the same
collective, whose MAX over one rank is the rank's own flag, so the watch must
find what a plain hook finds and skip that step's update, as without a group.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import nand
from tests.agent.models import mlp

BAD, STEPS = 3, 6


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.nand_mode("full")
@pytest.mark.parametrize("read", ["sync", "deferred"])
def test_an_agreed_read_finds_the_first_non_finite_layer_and_skips_its_update(one_rank_group, read):
    torch.manual_seed(0)
    model = mlp(plant_after=2)  # a Plant at "3" writes a NaN into its output at BAD
    first: list[tuple[int, str]] = []  # (step, module), found by plain hooks
    step_now = [0]

    def record(name: str):
        def hook(module, args, output) -> None:
            if not first and not torch.isfinite(output).all():
                first.append((step_now[0], name))

        return hook

    for name, module in model.named_children():
        module.register_forward_hook(record(name))
    # fused: a deferred skip is done on the device (read_mode), so the read is late
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    weights = []
    with nand.watch(model, opt, on_nonfinite="skip", read=read) as w:
        w._boundary.agree = True  # (build_boundary: only with world size > 1)
        for step in range(STEPS):
            step_now[0] = step
            model[3].value = math.nan if step == BAD else None
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            weights.append(model[5].weight.detach().clone())
    assert first == [(BAD, "3")]
    assert w.first is not None
    assert (w.first.step, w.first.module, w.first.phase) == (BAD, "3", "forward")
    assert len(w.events) == 1
    assert torch.equal(weights[BAD - 1], weights[BAD])  # the bad step's update: dropped
    assert not torch.equal(weights[BAD], weights[BAD + 1])  # the next one: applied
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.nand_mode("full")
def test_a_gradient_made_non_finite_on_the_only_ddp_rank_was_produced_there(one_rank_group):
    # DDP averages gradients across ranks, so a non-finite .grad may have come
    # from another rank; nand's local check (a DDP communication hook) reads
    # this rank's own before the all-reduce. With one rank nothing can be
    # received: the NaN a hook writes into one weight's gradient was made here.
    torch.manual_seed(0)
    inner = mlp()
    model = DistributedDataParallel(inner)
    weight = inner[4].weight
    step_now = [0]

    def plant(grad: torch.Tensor) -> torch.Tensor:
        if step_now[0] != BAD:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = math.nan
        return grad

    weight.register_hook(plant)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip") as w:
        for step in range(STEPS):
            step_now[0] = step
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert w.first is not None
    assert (w.first.step, w.first.phase, w.first.cause) == (BAD, "grad", "produced")
    assert w.first.module == "4.weight"
    assert all(torch.isfinite(p).all() for p in model.parameters())
