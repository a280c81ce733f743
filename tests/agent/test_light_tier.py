"""The light mode's way out: an incident its replay cannot make exact is said
as such, and every module is probed from then on (``detect/tiers.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nand
from tests.agent.models import arm_at, mlp
from tests.agent.models import train as train_loop
from tests.agent.test_rerun import Log, Streamed, batch, model_with, train


def test_a_light_replay_that_raises_says_what_was_checked_and_the_next_incident_is_exact():
    """The forward reads an iterator the step has spent: the replay raises.
    The first event is the light checks' (the root's output), says so, and
    the watch probes every module: the second incident names the layer."""
    model = Streamed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip", mode="light") as watch:
        for step in range(5):
            model.extra = iter([0.0 if step in (1, 3) else 1.0])  # log(0) at steps 1 and 3
            model(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first, second = watch.events
    assert (first.step, first.phase, first.module) == (1, "forward", "")
    assert first.replay.startswith("replay raised StopIteration")
    assert "light mode checked" in first.replay and "mode='full'" in first.replay
    assert (second.step, second.phase, second.module, second.cause) == (
        3, "forward", "log", "produced",
    )  # fmt: skip
    assert watch.step == 5


def test_a_light_incident_with_replays_off_is_not_exact_and_switches_to_the_full_mode(
    monkeypatch,
):
    monkeypatch.setenv("NAND_REPLAYS", "0")
    model = Streamed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip", mode="light") as watch:
        for step in range(5):
            model.extra = iter([0.0 if step in (1, 3) else 1.0])
            model(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first, second = watch.events
    assert (first.step, first.module) == (1, "")
    assert first.replay.startswith("not replayed: NAND_REPLAYS=0")
    assert (second.step, second.module, second.replay) == (3, "log", "")


def test_a_model_with_sync_batchnorm_is_probed_in_full_from_the_start():
    # A replay runs on one rank: SyncBatchNorm's forward would all-gather its
    # statistics with ranks that are not replaying, and wait for them forever.
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.SyncBatchNorm(8), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode="light") as watch:
        assert not watch._tiers.light
        hooked = [m for m in model.modules() if m._forward_hooks]
        assert model[1] in hooked and model[2] in hooked  # (light: the root only)


class Faulty(torch.nn.Module):
    """Two layers; ``mid``'s output gets a NaN while ``armed`` (a 0-d tensor,
    so that a compiled graph does not guard on it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(8, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.last = torch.nn.Linear(8, 1)
        self.armed = torch.zeros(())
        self.mid.register_forward_hook(lambda m, a, out: out + self.armed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.mid(self.first(x))))


def first_of_compiled_run(mode: str) -> tuple[object, ...]:
    """A model compiled (aot_eager) after nand.watch; ``mid`` goes NaN at step 2."""
    torch._dynamo.reset()
    model = Faulty()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode=mode, read="sync", log_events=False) as watch:
        run = torch.compile(model, backend="aot_eager")
        for step in range(3):
            model.armed.fill_(float("nan") if step == 2 else 0.0)
            run(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first = watch.first
    assert first is not None
    return first.step, first.micro_step, first.phase, first.module, first.cause


def test_a_model_compiled_after_a_light_watch_is_probed_as_in_the_full_mode_from_its_first_call():
    # Compiled code ignores hooks added after dynamo traced it: the light
    # mode hooks every module while the first compiled call is traced
    # (compile_switch.py). Before: the light event was the root's output,
    # not replayed (nothing is held from compiled code), and the switch to
    # the full mode came too late for the compiled graph.
    light = first_of_compiled_run("light")
    assert light == first_of_compiled_run("full") == (2, 0, "forward", "mid", "produced")


def first_of_a_loop_calling_parts(mode: str) -> tuple[object, ...]:
    """The loop calls the model's parts, never the model: ``mid`` goes NaN at step 2."""
    model = Faulty()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode=mode, read="sync", log_events=False) as watch:
        for step in range(3):
            model.armed.fill_(float("nan") if step == 2 else 0.0)
            hidden = torch.tanh(model.mid(model.first(batch(step))))
            model.last(hidden).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first = watch.first
    assert first is not None
    return first.step, first.phase, first.module, first.cause


def test_a_loop_calling_the_parts_of_a_light_watched_model_is_probed_as_in_the_full_mode():
    # No root call, nothing held, no replay possible: the first step read
    # without a root call turns the watch full (Tiers.window_read). Before:
    # the light event was a parameter's gradient.
    light = first_of_a_loop_calling_parts("light")
    assert light == first_of_a_loop_calling_parts("full") == (2, "forward", "mid", "produced")


def test_a_forward_fault_that_fires_once_is_not_reproduced_in_light_mode_and_goes_full():
    # A transient: the light checks see the root's output, the probed replay
    # finds nothing, so the event says not reproduced (suspect the device),
    # what was checked, and every module is probed from then on.
    model = model_with(Log(once_at=3))  # the third call: step 2
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip", mode="light") as watch:
        train(model, opt, 4)
    event = watch.first
    assert (event.step, event.phase, event.module) == (2, "forward", "")
    assert event.reproduced is False and "suspect the device" in event.message
    assert "light mode checked" in event.replay and not watch._tiers.light


class SafeLog(torch.nn.Module):
    """log where x > 0, else 0: finite forward; at x = 0 its backward is 0/0 = NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


def hidden_faults() -> dict[str, tuple[torch.nn.Module, Any, tuple[str, str]]]:
    """Non-finite values that a relu takes out again: -inf into it (relu(-inf)
    = 0), and the NaN gradient of a log of relu's zeros (relu's backward
    zeroes it). (model, its ``before`` for ``train``, the full mode's phase
    and module)."""
    torch.manual_seed(0)
    clipped = mlp(plant_after=0)  # Linear, Plant, ReLU, ...
    log_of_zeros = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), SafeLog(), torch.nn.Linear(16, 4)
    )
    return {
        "-inf into a relu": (clipped, arm_at(clipped[1], 1, float("-inf")), ("forward", "1")),
        "NaN gradient into a relu": (log_of_zeros, None, ("backward", "2")),
    }


@pytest.mark.parametrize("name", list(hidden_faults()))
def test_a_value_a_relu_takes_out_is_found_by_the_full_mode_only(name):
    # Ground truth without nand: the output, the loss, every gradient and
    # weight stay finite, so none of the light checks can see the value;
    # only a probe per module does (README, Light mode: what it does not see).
    model, before, (phase, module) = hidden_faults()[name]
    if before is not None:
        before(1, 0)
    out = model(torch.randn(4, 8))
    out.pow(2).mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() and torch.isfinite(p).all() for p in model.parameters())
    model.zero_grad()
    firsts = {}
    for mode in ("light", "full"):
        model, before, _ = hidden_faults()[name]
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with nand.watch(model, opt, mode=mode, log_events=False) as watch:
            train_loop(model, opt, 2, before=before)
        firsts[mode] = watch.first
    assert firsts["light"] is None
    assert firsts["full"] is not None
    assert (firsts["full"].phase, firsts["full"].module) == (phase, module)
