"""``optimizer.step(closure)``: forward and backward run inside ``step``, after
its pre-hook (Lightning's automatic optimization, LBFGS). nand must see the
same step, phase and module as without a closure, and act before the update."""

from __future__ import annotations

import pytest
import torch

import nand
from tests.agent.models import BackwardPlant, Plant, mlp, where


def _model(fault: str) -> torch.nn.Sequential:
    """An MLP with a plant of the given kind after its second Linear."""
    model = mlp(plant_after=2)
    if fault == "backward":
        model[3] = BackwardPlant()
    return model


def _train(model, opt, steps: int, fault_step: int, value: float, closure: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    plant = model[3]
    for step in range(steps):
        plant.value = value if step == fault_step else None
        x = torch.randn(4, 8, generator=gen)

        def loss_of_batch(x=x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        if closure:
            opt.step(loss_of_batch)
        else:
            loss_of_batch()
            opt.step()


def _first(fault: str, closure: bool, policy: str = "warn") -> tuple[nand.Event, bool]:
    torch.manual_seed(0)
    model = _model(fault)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    try:
        with nand.watch(model, opt, on_nonfinite=policy) as w:
            _train(model, opt, 6, fault_step=3, value=float("nan"), closure=closure)
    except nand.NonFiniteError:
        pass
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert w.first is not None
    return w.first, finite


@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_a_fault_found_through_a_closure_is_where_it_is_without_one(fault):
    with_closure, _ = _first(fault, closure=True)
    without, _ = _first(fault, closure=False)
    assert where(with_closure) == where(without)
    assert where(with_closure)[:4] == (3, 0, fault, "3")


@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_raise_through_a_closure_stops_before_the_update(fault):
    first, finite = _first(fault, closure=True, policy="raise")
    assert (first.step, first.phase) == (3, fault)
    assert finite


def test_skip_through_a_closure_drops_that_update_only():
    torch.manual_seed(0)
    model = _model("forward")
    model[3] = Plant()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    updates = []
    opt.register_step_post_hook(lambda *_: updates.append([p.clone() for p in model.parameters()]))
    with nand.watch(model, opt, on_nonfinite="skip") as w:
        _train(model, opt, 5, fault_step=2, value=float("inf"), closure=True)
    assert w.step == 5 and w.first.step == 2
    unchanged = [torch.equal(a, b) for a, b in zip(updates[1], updates[2], strict=True)]
    assert all(unchanged)  # step 2's update was dropped
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# The NaN is set for the 7th evaluation only, and gone at the next: a
# transient, which the light mode's replay cannot see again (see
# tests/integrations/check.py, replayed_armed): the full mode's labelling.
@pytest.mark.nand_mode("full")
def test_each_evaluation_of_an_lbfgs_step_is_checked_as_a_micro_step_of_it():
    torch.manual_seed(0)
    model = mlp(plant_after=2)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4)
    x = torch.randn(4, 8)
    evaluations = []

    def closure():
        evaluations.append(len(evaluations))
        model[3].value = float("nan") if len(evaluations) == 7 else None
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    calls_per_step = []
    with nand.watch(model, opt) as w:
        for _ in range(3):
            before = len(evaluations)
            opt.step(closure)
            calls_per_step.append(len(evaluations) - before)
    # the 7th evaluation overall: which step, and which evaluation within it
    step, done = 0, 0
    while done + calls_per_step[step] < 7:
        done += calls_per_step[step]
        step += 1
    assert (w.first.step, w.first.micro_step) == (step, 7 - done - 1)
    assert (w.first.phase, w.first.module) == ("forward", "3")
