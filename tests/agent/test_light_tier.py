"""The light mode's way out: an incident its replay cannot make exact is said
as such, and every module is probed from then on (``detect/tiers.py``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import nand
from tests.agent.models import arm_at, mlp
from tests.agent.models import train as train_loop
from tests.agent.test_rerun import Log, Streamed, batch, model_with, train
from tests.integrations.test_compile import recorded


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
        3,
        "forward",
        "log",
        "produced",
    )
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


def streamed_run(steps: int, bad: tuple[int, ...]) -> tuple[list[Any], list[str]]:
    """A light watch of :class:`Streamed`, log(0) at the ``bad`` steps (a
    replay of it raises: never exact); its events and nand's warnings."""
    model = Streamed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    options: dict[str, Any] = {"on_nonfinite": "skip", "mode": "light", "log_events": False}
    with recorded("nand") as log, nand.watch(model, opt, **options) as w:
        for step in range(steps):
            model.extra = iter([0.0 if step in bad else 1.0])
            model(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert w.step == steps
    said = [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]
    return w.events, [m for m in said if "skipped optimizer step" not in m]  # (the policy's)


def test_after_an_incident_not_made_exact_every_module_is_probed_for_full_steps_then_light(
    monkeypatch,
):
    # NAND_FULL_STEPS=2: the inexact incident at step 1 turns the watch full
    # for steps 2 and 3 (step 3's incident is the full mode's: exact), then
    # light again (step 6's is the root's, not made exact, and turns it full
    # again). Before: full for the rest of the run, step 6's event exact.
    monkeypatch.setenv("NAND_FULL_STEPS", "2")
    events, warnings = streamed_run(8, bad=(1, 3, 6))
    assert [(e.step, e.module) for e in events] == [(1, ""), (3, "log"), (6, "")]
    for light in (events[0], events[2]):
        assert "light mode checked" in light.replay
        assert "probed for the next 2 steps (mode='full'), then light again" in light.replay
    assert events[1].cause == "produced"
    assert [m.split("; ")[-1] for m in warnings] == [
        "every module is probed for the next 2 steps (mode='full'), then light again",
        "back to the light mode",
        "every module is probed for the next 2 steps (mode='full'), then light again",
    ]


def test_with_full_steps_zero_an_incident_not_made_exact_leaves_the_light_mode_on(monkeypatch):
    monkeypatch.setenv("NAND_FULL_STEPS", "0")
    events, warnings = streamed_run(5, bad=(1, 3))
    assert [(e.step, e.module) for e in events] == [(1, ""), (3, "")]
    assert events[0].replay.endswith("the light mode goes on (NAND_FULL_STEPS=0)")
    assert warnings == []


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
    assert watch._tiers.light == (mode == "light")  # (light: no switch at trace time)
    return first.step, first.micro_step, first.phase, first.module, first.cause


def test_a_model_compiled_after_a_light_watch_stays_light_and_its_replay_names_the_layer():
    # Compiled code calls the root's hooks outside its graph, so the step is
    # held, and its replay runs under force_eager with every module probed
    # (detect/eager.py): the full mode's answer, without its probes on every
    # step. Before: the light mode turned full while the first compiled call
    # was traced (compile_switch.py, now for torch < 2.6 only).
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
