"""On a GPU: nand never synchronises the host with the device on a healthy
step in ``warn`` (the light mode: through a fused optimizer, which skips a bad
update on the device; the full mode: any) and in deferred ``skip`` through a
fused optimizer: CUDA's sync debug mode
turns any synchronising call (``.item()``, ``tolist()`` of a CUDA tensor, a
blocking copy) into an error, the optimizer step and nand's boundary included."""

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
            opt.step()  # the step boundary: deferred on CUDA, see the tests below
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


def _steps_without_sync(model, opt, steps, plant_at=None):
    """Train ``steps`` steps with CUDA's sync debug mode set to "error" around
    everything, the optimizer step (nand's boundary) included."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(steps):
        model[1].value = float("nan") if step == plant_at else None
        x = torch.randn(4, 8, device="cuda", generator=gen)
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.nand_mode("full")  # (the light mode reads a plain SGD's steps in sync: below)
def test_warn_on_cuda_reads_deferred_with_zero_syncs_per_step():
    model = mlp(plant_after=0).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:  # read="auto": deferred on CUDA under warn
        assert w.deferred
        _steps_without_sync(model, opt, 2)  # first steps: pinned buffers made
        _steps_without_sync(model, opt, 20, plant_at=10)
        assert w.first is not None and w.first.step == 12  # (2 warm-up steps before)
    assert (w.first.phase, w.first.module) == ("forward", "1") and w.host_reads == 23
    print(f"deferred reads that waited for their copy: {w.read_waits} of {w.host_reads}")


def test_skip_through_a_fused_optimizer_on_cuda_has_zero_syncs_and_keeps_weights_finite():
    model = mlp(plant_after=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with nand.watch(model, opt, on_nonfinite="skip") as w:
        assert w.deferred
        _steps_without_sync(model, opt, 2)
        _steps_without_sync(model, opt, 10, plant_at=4)
    assert w.first is not None and (w.first.step, w.first.phase) == (6, "forward")
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_light_warn_through_a_fused_optimizer_reads_deferred_and_replays_with_the_steps_weights():
    # The light mode replays a bad step at the next boundary, so it reads late
    # only where the optimizer can skip the bad update on the device.
    model = mlp(plant_after=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with nand.watch(model, opt, mode="light") as w:
        assert w.deferred
        _steps_without_sync(model, opt, 2)
        _steps_without_sync(model, opt, 20)  # healthy: not one sync
        assert w.first is None
        for step in range(3):  # (the incident's replay may sync: outside the debug mode)
            model[1].value = float("nan") if step == 1 else None
            model(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first = w.first
    assert first is not None and (first.step, first.phase, first.module) == (23, "forward", "1")
    assert first.reproduced is True
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())  # (update skipped)
