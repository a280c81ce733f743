"""The deferred read (``read="deferred"``): each window is copied at its
boundary and read at the next one. On CPU the copy is synchronous, so these
tests hold the ordering and the analysis the CUDA path shares."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import nand
from nand.agent.step.deferred import DeferredRead
from nand.errors import ConfigError
from tests.agent.models import (
    VALUES,
    BackwardPlant,
    arm_at,
    arm_on_batch,
    mlp,
    train,
    where,
    write_grad,
)
from tests.agent.test_costs import CountReads, CountSyncs
from tests.agent.test_detection import corrupt_after_step

KINDS = pytest.mark.parametrize("kind", list(VALUES))


# --- the component --------------------------------------------------------------


def test_windows_are_read_in_order_each_with_its_own_meta():
    read: DeferredRead[int] = DeferredRead()
    read.put(torch.tensor([1.0, 2.0]), 0)
    read.put(None, 1)  # a window with nothing to read keeps its place
    assert read.take() == ([1.0, 2.0], 0)
    read.put(torch.tensor([3.0], dtype=torch.float64), 2)
    assert read.take() == (None, 1)
    assert read.take() == ([3.0], 2)
    assert read.take() is None and len(read) == 0 and read.waits == 0


def test_a_copy_never_lands_in_a_buffer_not_read_yet():
    read: DeferredRead[int] = DeferredRead()
    source = torch.tensor([1.0, 2.0])
    read.put(source, 0)
    source.fill_(9.0)  # the slab is refilled by the next window: the copy is its own
    read.put(source, 1)
    with pytest.raises(RuntimeError, match="not read yet"):
        read.put(source, 2)
    assert read.take() == ([1.0, 2.0], 0)
    read.put(torch.tensor([5.0, 6.0, 7.0]), 2)  # the buffer just read is reused (and grown)
    assert read.take() == ([9.0, 9.0], 1) and read.take() == ([5.0, 6.0, 7.0], 2)


# --- choosing the read ------------------------------------------------------------


def test_auto_reads_in_sync_on_cpu_and_deferred_can_be_forced(monkeypatch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nand.watch(model, opt) as w:
        assert not w.deferred
    with nand.watch(model, opt, read="deferred") as w:
        assert w.deferred
    monkeypatch.setenv("NAND_READ", "deferred")
    with nand.watch(model, opt) as w:
        assert w.deferred


def test_an_unknown_read_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("NAND_READ", "later")
    with pytest.raises(ConfigError, match="auto, sync, deferred"):
        nand.watch(mlp(), None)


@pytest.mark.parametrize("policy", ["raise", "stop"])
def test_raise_and_stop_refuse_the_deferred_read(policy):
    with pytest.raises(ConfigError, match="reads in sync"):
        nand.watch(mlp(), None, on_nonfinite=policy, read="deferred")


@pytest.mark.parametrize(
    ("make", "on_device"),
    [
        (lambda ps: torch.optim.Adam(ps, fused=True), True),
        (lambda ps: torch.optim.AdamW(ps, fused=True), True),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True), True),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), False),
        (lambda ps: torch.optim.Adam(ps), False),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), False),
    ],
    ids=["adam", "adamw", "sgd", "sgd-momentum", "adam-foreach", "sgd-plain"],
)
def test_skip_defers_only_where_the_optimizer_skips_on_the_device(make, on_device, caplog):
    model = mlp()
    with nand.watch(model, make(model.parameters()), on_nonfinite="skip", read="deferred") as w:
        assert w.deferred is on_device
    fallback = [r for r in caplog.records if "reading in sync" in r.getMessage()]
    assert len(fallback) == (0 if on_device else 1)


# --- ordering: the true step, one boundary later, nothing lost ---------------------


@KINDS
def test_an_event_keeps_its_step_and_is_reported_at_the_next_boundary(kind):
    # The plant last: a -inf before a ReLU never reaches the step's own figures,
    # which is all the light mode checks. (fused: the light mode replays a step
    # read late only where the optimizer skipped its update on the device)
    model = mlp(plant_after=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    seen = []
    arm = arm_on_batch(model, model[5], 2, VALUES[kind])
    with nand.watch(model, opt, read="deferred") as w:

        def before(step: int, micro: int) -> None:
            seen.append(w.first.step if w.first else None)
            arm(step, micro)

        train(model, opt, 5, before=before)
    assert seen == [None, None, None, None, 2]  # read at step 3's boundary
    assert where(w.first) == (2, 0, "forward", "5", "produced")
    assert w.host_reads == 6  # one per step, and the last look at close()


@KINDS
def test_the_same_first_event_as_the_sync_read(kind):
    """Forward, backward and an external write into a parameter (which the
    sync read finds through the implied-finite bound and the next forward;
    the deferred read by reading the parameters every step)."""

    def run(read: str, fault: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), BackwardPlant(), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        arm = arm_on_batch(model, model[1], 3 if fault == "backward" else -1, VALUES[kind])

        def before(step: int, micro: int) -> None:
            arm(step, micro)
            if (fault, step) == ("param", 3):
                with torch.no_grad():
                    model[3].bias[1] = VALUES[kind]

        with nand.watch(model, opt, read=read) as w:
            train(model, opt, 6, before=before)
        return where(w.first), w.first.nan, [e.step for e in w.events]

    for fault in ("backward", "param"):
        assert run("deferred", fault)[0] == run("sync", fault)[0], fault
    assert run("deferred", "param")[0] == (2, 0, "param", "3.bias", "produced")


def test_the_last_step_is_read_at_close():
    model = mlp(plant_after=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    w = nand.watch(model, opt, read="deferred")
    train(model, opt, 4, before=arm_on_batch(model, model[1], 3, math.nan))
    assert w.first is None  # step 3's window is still on its way
    w.close()
    assert where(w.first) == (3, 0, "forward", "1", "produced")


def test_what_the_last_update_wrote_is_read_at_close():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    corrupt_after_step(opt, 3, lambda: model[4].bias.data.__setitem__(1, math.nan))
    with nand.watch(model, opt, read="deferred") as w:
        train(model, opt, 4)
        assert w.first is None
    assert where(w.first) == (3, 0, "param", "4.bias", "produced")


def test_an_exception_in_the_loop_still_reads_the_pending_window():
    model = mlp(plant_after=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    with pytest.raises(KeyError), nand.watch(model, opt, read="deferred") as w:
        train(model, opt, 2, before=arm_on_batch(model, model[1], 1, math.inf))
        raise KeyError("the loop's own error")
    assert where(w.first) == (1, 0, "forward", "1", "produced")


@pytest.mark.parametrize("crash", [False, True], ids=["exit", "unhandled-exception"])
def test_a_watch_never_closed_reports_its_pending_window_at_exit(tmp_path, crash):
    events = tmp_path / "events.jsonl"
    script = f"""
        import math, torch, nand
        from tests.agent.models import mlp, train, arm_on_batch
        model = mlp(plant_after=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
        w = nand.watch(model, opt, read="deferred", events_file={str(events)!r})
        train(model, opt, 3, before=arm_on_batch(model, model[1], 2, math.nan))
        assert w.first is None
        if {crash}:
            raise SystemError("the loop died")
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == (1 if crash else 0), done.stderr
    assert "NaN in forward of 1 (Plant) at step 2" in done.stderr
    if not crash:  # closed at exit: the JSONL writer is flushed, and says bye
        assert events.read_text().count('"phase": "forward"') == 1


# --- what the lagged analysis uses ------------------------------------------------


def test_the_flight_recorder_and_heartbeat_figures_are_those_of_the_sync_read():
    def run(read: str):
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with nand.watch(model, opt, read=read) as w:
            train(model, opt, 5)
        return w.flight_window()

    sync, deferred = run("sync"), run("deferred")
    assert deferred.steps == sync.steps == [0, 1, 2, 3, 4]
    assert deferred.act_max_abs == sync.act_max_abs
    assert deferred.grad_norm == pytest.approx(sync.grad_norm, rel=1e-6)


def test_the_headroom_warning_names_the_step_that_came_close(caplog):
    model = mlp(plant_after=4)  # (at the model's output: the light mode's headroom too)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nand.watch(model, opt, read="deferred"):
        train(model, opt, 4, before=arm_at(model[5], 2, 3e38))
    warnings = [r.getMessage() for r in caplog.records if "headroom" in r.getMessage()]
    assert len(warnings) == 1 and "at step 2" in warnings[0]


@KINDS
def test_a_gradient_read_late_is_reported_exactly_without_counts(kind):
    """The gradient is zeroed by the time its window is read: the finding
    stands on its float64-accumulated norm, no element counts."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt, read="deferred") as w:
        train(model, opt, 4, after_backward=write_grad(model[2].weight, 2, VALUES[kind]))
    assert where(w.first) == (2, 0, "grad", "2.weight", "produced")
    assert w.first.nan is None and "not re-checked" not in w.first.message


def test_finite_gradients_whose_float32_norm_overflows_are_no_false_alarm():
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nand.watch(model, opt, read="deferred") as w:
        for _ in range(3):
            model(torch.randn(2, 64)).sum().backward()
            model.weight.grad.fill_(1e30)  # finite; its float32 2-norm is inf
            opt.step()
            opt.zero_grad()
    assert w.first is None


def test_a_float64_tensor_read_late_is_marked_unverified():
    model = nn.Linear(4, 4).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nand.watch(model, opt, read="deferred") as w:
        for step in range(3):
            model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
            if step == 1:
                model.weight.grad[0, 0] = math.nan
            opt.step()
            opt.zero_grad()
    assert where(w.first) == (1, 0, "grad", "weight", "produced")
    assert "not re-checked" in w.first.message


def test_deferred_reads_the_host_once_per_step_and_adds_no_sync():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, read="deferred") as w:
        train(model, opt, 2)
        with CountSyncs() as syncs, CountReads() as reads:
            train(model, opt, 10, accum=2)
    assert syncs.count == 0 and reads.count == 10 and w.read_waits == 0


# --- skip on the device -----------------------------------------------------------


def _fused(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimizer that can skip an update on the device (``fused=True``)."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-2, fused=True)


@pytest.mark.parametrize("fused", ["adamw", "sgd"])
def test_skip_on_the_device_keeps_the_weights_and_the_gradients(fused, caplog):
    caplog.set_level(logging.WARNING, logger="nand")
    model = mlp(plant_after=0)
    opt = _fused(fused, model)
    before_bad: list[torch.Tensor] = []
    after_bad: list[torch.Tensor] = []
    arm = arm_on_batch(model, model[1], 2, math.nan)
    with nand.watch(model, opt, on_nonfinite="skip", read="deferred") as w:
        for step in range(5):
            arm(step, 0)
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if step == 2:
                before_bad = [p.detach().clone() for p in model.parameters()]
            opt.step()
            assert all(p.grad is not None for p in model.parameters())  # nothing dropped
            assert "found_inf" not in vars(opt)  # handed for the step only
            if step == 2:
                after_bad = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before_bad, after_bad, strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert where(w.first) == (2, 0, "forward", "1", "produced") and w.step == 5
    # Replayed at step 3's boundary: the weights are still those step 2 ran with.
    assert w.first.replay.startswith("replayed the forward of micro-step 0")
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == ["nand: skipped optimizer step 2 on the device (non-finite)"]
    if fused == "adamw":  # the skipped step is not counted by Adam either
        assert all(s["step"].item() == 4 for s in opt.state.values())


def test_skip_on_the_device_takes_the_larger_of_its_flag_and_the_scalers():
    """A GradScaler hands the fused optimizer its found_inf: nand keeps the
    scaler's overflow skips and adds its own, never clearing the scaler's."""
    model = mlp(plant_after=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows at first
    arm = arm_on_batch(model, model[1], 35, math.nan)
    with nand.watch(model, opt, on_nonfinite="skip", read="deferred") as w:
        gen = torch.Generator().manual_seed(0)
        for step in range(40):
            arm(step, 0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert w.amp_skipped > 0 and w.step == 40
    assert where(w.first) == (35, 0, "forward", "1", "produced")
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- the light mode read late: the bad update skipped on the device, for a replay ---


@pytest.mark.parametrize("fused", ["adamw", "sgd"])
def test_light_warn_read_late_skips_the_bad_update_on_the_device_and_replays_it_exactly(
    fused, caplog
):
    """Under ``warn`` too: step 2's replay, at step 3's boundary, runs with
    the weights step 2 ran with, and names the module as the full mode does."""
    caplog.set_level(logging.WARNING, logger="nand")
    model = mlp(plant_after=0)
    opt = _fused(fused, model)
    arm = arm_on_batch(model, model[1], 2, math.nan)
    weights: dict[str, list[torch.Tensor]] = {}
    with nand.watch(model, opt, mode="light", read="deferred") as w:  # (on_nonfinite="warn")
        assert w.deferred
        for step in range(5):
            arm(step, 0)
            model(torch.randn(4, 8)).pow(2).mean().backward()
            weights[f"before {step}"] = [p.detach().clone() for p in model.parameters()]
            opt.step()
            weights[f"after {step}"] = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
    assert where(w.first) == (2, 0, "forward", "1", "produced") and w.first.reproduced
    assert all(map(torch.equal, weights["before 2"], weights["after 2"]))  # skipped
    assert not any(map(torch.equal, weights["before 3"], weights["after 3"]))  # not the next
    said = [r.getMessage() for r in caplog.records]
    assert "nand: skipped optimizer step 2 on the device (non-finite)" in said
    assert not any("every module is probed" in line for line in said)  # exact: still light


def test_light_read_late_with_an_optimizer_that_cannot_skip_says_so_and_probes_every_module():
    """``read="deferred"`` asked with a plain SGD: read late as asked, the update
    applied, so no replay: the event says what was checked (issue 32, §6)."""
    model = mlp(plant_after=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode="light", read="deferred") as w:
        assert w.deferred
        train(model, opt, 6, before=arm_on_batch(model, model[1], 2, math.nan))
    assert where(w.first) == (2, 0, "forward", "", "produced")  # the light event, said as such
    assert "read one step late" in w.first.replay
    assert "every module is probed for the next 100 steps" in w.first.replay


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.log()


def test_light_read_late_without_an_optimizer_replays_the_call_that_went_bad():
    """No optimizer, no update: a root call read at the next one is replayed
    with the weights it ran with. The fault is the data's (a negative number
    into a log), so the replay makes it again and names the module."""
    model = nn.Sequential(Log(), nn.Linear(8, 4))
    gen = torch.Generator().manual_seed(0)
    with nand.watch(model, None, mode="light", read="deferred") as w, torch.no_grad():
        assert w.deferred
        for call in range(5):
            x = torch.rand(4, 8, generator=gen) + 0.1
            if call == 2:
                x[1, 3] = -1.0
            model(x)
    assert where(w.first) == (2, 0, "forward", "0", "produced") and w.first.reproduced
    assert len(w.events) == 1
