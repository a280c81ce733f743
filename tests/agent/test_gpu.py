"""On a GPU: the hooks never synchronise (CUDA sync debug mode turns a sync into an error)."""

from __future__ import annotations

import pytest
import torch

import nand
from tests.agent.models import mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_forward_and_backward_hooks_never_sync_on_cuda():
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, device="cuda")
    with nand.watch(model, opt) as w:
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            try:
                model(x).pow(2).mean().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            opt.step()  # the step boundary: the one read per step (a sync, for now)
            opt.zero_grad()
    assert w.first is None and w.step == 3 and w.host_reads == 4


def test_a_nan_on_cuda_is_found_like_on_cpu():
    model = mlp(plant_after=0).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:
        for step in range(3):
            model[1].value = float("nan") if step == 1 else None
            model(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert (w.first.step, w.first.phase, w.first.module) == (1, "forward", "1")
