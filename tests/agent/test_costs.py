"""Cost rules: no sync in hooks, one host read per step, bounded memory, clean removal."""

from __future__ import annotations

import gc
import logging
import tracemalloc
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nand
from tests.agent.models import mlp, train

SYNC_OPS = {"_local_scalar_dense", "item", "_to_copy", "to", "copy_"}


class CountSyncs(TorchDispatchMode):
    """Counts ops that read a value to the host (or copy off a device)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or (
            name in ("_to_copy", "copy_")
            and any(getattr(a, "device", None) not in (None, torch.device("cpu")) for a in args)
        ):
            self.count += 1
            self.names.append(name)
        return func(*args, **(kwargs or {}))


class CountReads:
    """Counts Tensor.tolist/item/__bool__/cpu/numpy calls made from Python."""

    METHODS = ("tolist", "item", "__bool__", "cpu", "numpy")

    def __init__(self) -> None:
        self.count = 0
        self._orig: dict[str, Any] = {}

    def __enter__(self) -> CountReads:
        for name in self.METHODS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def counted(t: torch.Tensor, *a: Any, _orig: Any = orig, **k: Any) -> Any:
                self.count += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)


def sgd_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, accum: int = 1) -> None:
    for _ in range(steps):
        for _ in range(accum):
            model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_hooks_never_sync_and_nand_reads_the_host_once_per_optimizer_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    baseline_model = mlp()
    baseline_opt = torch.optim.SGD(baseline_model.parameters(), lr=1e-2, momentum=0.9)
    with CountSyncs() as base_syncs, CountReads() as base_reads:
        sgd_steps(baseline_model, baseline_opt, 10, accum=3)
    with nand.watch(model, opt) as w:
        sgd_steps(model, opt, 2)  # first steps warm caches up
        with CountSyncs() as syncs, CountReads() as reads:
            sgd_steps(model, opt, 10, accum=3)
    assert syncs.count == base_syncs.count  # nand adds no .item() / bool(tensor) / d2h copy
    assert reads.count - base_reads.count == 10  # one tolist() per optimizer step
    assert w.host_reads == 13  # 12 steps + the last look at close()


def test_close_leaves_no_hook_behind():
    layer = nn.TransformerEncoderLayer(4, 2, 8, batch_first=True)
    model = nn.Sequential(mlp(), nn.Linear(4, 4), layer)
    opt = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    update = scaler.update
    w = nand.watch(model, opt, scaler=scaler)
    w.close()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m)
        assert not m._backward_hooks and not m._forward_hooks_with_kwargs
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    for p in model.parameters():  # the bias proxies' hooks
        assert not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None)
    assert "update" not in scaler.__dict__ and scaler.update == update
    w.close()  # idempotent


def test_memory_stays_bounded_over_thousands_of_steps():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nand.watch(model, opt, flight_steps=16, on_nonfinite="skip") as w:
        sgd_steps(model, opt, 300)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        sgd_steps(model, opt, 2000)
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert growth < 200_000, growth
    assert len(w.recorder.rows) == 16 and len(w._buf) == 0


@pytest.mark.nand_mode("full")  # (the light mode's window grows by a few entries a call)
def test_an_optimizer_that_never_steps_does_not_grow_the_buffer(monkeypatch):
    # Forward/backward forever, never opt.step() (evaluation with grads, or a
    # forgotten step): the window is read once it passes MAX_WINDOW entries.
    from nand.agent.detect import hooks

    monkeypatch.setattr(hooks, "MAX_WINDOW", 50)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nand.watch(model, opt) as w:
        for _ in range(40):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            assert len(w._buf) <= 50 + 20  # one root call adds ~8 entries
        assert w.host_reads >= 4 and w.step == 0


def test_a_healthy_run_reports_nothing(caplog):
    caplog.set_level(logging.INFO, logger="nand")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nand.watch(model, opt) as w:
        train(model, opt, 50, accum=2)
    assert w.first is None and w.events == [] and w.nonfinite_steps == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.nand_internal_error_expected
def test_an_internal_error_is_logged_once_and_never_reaches_the_training_loop(caplog, monkeypatch):
    from nand.agent.step import blowup

    def broken(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("a bug inside nand")

    monkeypatch.setattr(blowup, "near_limit", broken)  # runs on every step read
    caplog.set_level(logging.ERROR, logger="nand")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nand.watch(model, opt) as w:
        train(model, opt, 5)
    errors = [r for r in caplog.records if r.name == "nand" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "switched itself off" in errors[0].getMessage()
    assert w.step == 0 or w.step == 5  # training ran to the end either way
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.nand_internal_error_expected
def test_a_failing_sink_is_dropped_without_breaking_training(caplog):
    class Broken:
        def __getattr__(self, name: str) -> Any:
            def fail(*args: Any) -> Any:
                raise OSError("disk full")

            return fail

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nand.watch(model, opt, log_events=False) as w:
        w.session.add_sink(Broken())
        train(model, opt, 3)
    assert w.step == 3 and w.session.sinks == []


def test_nand_disable_hooks_nothing(monkeypatch):
    monkeypatch.setenv("NAND_DISABLE", "1")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nand.watch(model, opt)
    assert not any(m._forward_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks
