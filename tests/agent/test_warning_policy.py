"""``on_warning``: what a run does with an early warning (``StepPolicy.alerted``).

One bad batch (its labels 30 times too large) at a known step makes the loss
spike while everything stays finite. Which step spiked is found by the loop
itself, from its own losses (three times the mean of the 20 before, the rule
the warning states); the weights before and after that step show whether its
update was applied.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

import nand
from tests.agent.models import mlp

BAD = 25


def train(
    w, model, opt, losses: list[float] | None = None, steps: int = 30
) -> tuple[list[float], dict[int, torch.Tensor]]:
    """Steps of a small regression, the batch at BAD with labels 30x too large; the
    losses (the ground truth, into ``losses`` as they come) and the last layer's
    weights before each step."""
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = [] if losses is None else losses
    before: dict[int, torch.Tensor] = {}
    for step in range(steps):
        before[step] = model[-1].weight.detach().clone()
        target = y * 30 if step == BAD else y
        loss = F.mse_loss(model(x), target)
        w.loss(loss)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    before[steps] = model[-1].weight.detach().clone()
    return losses, before


def spikes(losses: list[float]) -> list[int]:
    return [s for s in range(20, len(losses)) if losses[s] > 3 * sum(losses[s - 20 : s]) / 20]


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = mlp()
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def test_on_warning_raise_stops_at_the_spiking_step_before_its_update() -> None:
    model, opt = setup()
    losses: list[float] = []
    with (
        nand.watch(model, opt, on_warning="raise", log_events=False) as w,
        pytest.raises(nand.EarlyWarning) as info,
    ):
        train(w, model, opt, losses)
    # Raised from opt.step() of the bad batch: its loss was the last one computed.
    assert spikes(losses) == [len(losses) - 1] == [BAD]
    assert info.value.alert.step == BAD
    assert info.value.alert.kind == "loss_spike"  # the first warning: the loop's own rule's
    assert w.first is None  # a warning, not a non-finite value


def test_on_warning_skip_drops_only_the_spiking_steps_update(caplog) -> None:
    model, opt = setup()
    with (
        caplog.at_level(logging.WARNING, logger="nand"),
        nand.watch(model, opt, on_warning="skip", log_events=False) as w,
    ):
        losses, before = train(w, model, opt)
    assert spikes(losses) == [BAD]
    assert torch.equal(before[BAD], before[BAD + 1])  # the bad batch's update: dropped
    assert not torch.equal(before[BAD - 1], before[BAD])  # the others applied
    assert not torch.equal(before[BAD + 1], before[BAD + 2])
    skipped = [r.getMessage() for r in caplog.records if "skipped optimizer step" in r.getMessage()]
    # The loop's own rule found a loss spike at BAD (the first warning the
    # step raised; its gradient norm may warn too): the message names it.
    assert skipped == [f"nand: skipped optimizer step {BAD} (loss_spike)"]
    assert w.first is None


def test_on_warning_log_applies_every_update() -> None:
    model, opt = setup()
    with nand.watch(model, opt, on_warning="log", log_events=False) as w:
        losses, before = train(w, model, opt)
    assert spikes(losses) == [BAD]
    assert all(not torch.equal(before[s], before[s + 1]) for s in range(len(losses)))


def test_on_warning_skip_read_one_step_late_applies_the_update_and_says_so(caplog) -> None:
    model, opt = setup()
    with (
        caplog.at_level(logging.WARNING, logger="nand"),
        nand.watch(model, opt, on_warning="skip", read="deferred", log_events=False) as w,
    ):
        losses, before = train(w, model, opt)
    assert spikes(losses) == [BAD]
    assert not torch.equal(before[BAD], before[BAD + 1])  # too late to drop it
    said = [r.getMessage() for r in caplog.records if "warned" in r.getMessage()]
    assert said == [f"nand: step {BAD} warned, read one step late: not skipped"]


def test_the_growth_warning_names_the_step_whose_gradient_norm_the_loop_saw_jump(tmp_path) -> None:
    model, opt = setup()
    norms: list[float] = []
    params = list(model.parameters())
    real_step = opt.step

    def step_measuring(*args, **kwargs):  # the loop's own gradient norm, before the update
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        return real_step(*args, **kwargs)

    opt.step = step_measuring  # type: ignore[method-assign]
    events = tmp_path / "e.jsonl"
    with nand.watch(model, opt, events_file=str(events), log_events=False) as w:
        train(w, model, opt)
    jumps = [s for s in range(10, len(norms)) if norms[s] > 10 * sorted(norms[:s])[s // 2]]
    assert jumps == [BAD]
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    warned = sorted(
        (x["warning"]["kind"], x["warning"]["step"]) for x in lines if x["type"] == "warning"
    )
    assert ("grad_growth", BAD) in warned and ("loss_spike", BAD) in warned
