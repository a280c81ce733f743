"""A copy of a watched model (``copy.deepcopy``: an EMA model, say) is not watched.

``deepcopy`` copies torch's hook dictionaries, and with them nand's hooks
(as no-ops, see ``hooks.SavableHook``): a copy must not report into the
original's watch (its probes landing in the training window, its forward
counted as a micro-step).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nand
from tests.agent.models import arm_at, mlp, train, where


class Block(nn.Module):
    """A non-Sequential root: container hooks, a root pre-hook and a root hook."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(plant_after=2)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * 2


def plant_of(model: nn.Module) -> nn.Module:
    return model.body[3] if isinstance(model, Block) else model[3]


@pytest.mark.parametrize("make", [lambda: mlp(plant_after=2), Block], ids=["sequential", "block"])
def test_a_copy_made_after_watch_reports_nothing_into_the_watch(make):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:
        train(model, opt, 2)
        ema = copy.deepcopy(model)
        plant_of(ema).value = float("nan")  # the copy goes NaN: not the watched model
        forwards = []

        def copy_forward(step: int, micro: int) -> None:
            with torch.no_grad():
                forwards.append(ema(torch.randn(4, 8)))

        train(model, opt, 3, before=copy_forward)
        assert all(torch.isnan(out).any() for out in forwards)
        assert w.first is None and w.nonfinite_steps == 0
        # The copy's forwards are no micro-steps of the watched model: a fault
        # planted there is still found at its own step, micro-step 0.
        arm = arm_at(plant_of(model), step=1, value=float("inf"))

        def both(step: int, micro: int) -> None:
            copy_forward(step, micro)
            arm(step, micro)

        train(model, opt, 2, before=both)
    assert w.first is not None
    assert where(w.first)[1:3] == (0, "forward") and w.first.step == 6


def test_a_copy_can_be_watched_on_its_own():
    model = mlp(plant_after=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:
        train(model, opt, 1)
        twin = copy.deepcopy(model)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=1e-2)
        with nand.watch(twin, twin_opt) as w_twin:
            train(twin, twin_opt, 3, before=arm_at(twin[3], step=1, value=float("nan")))
    assert w.first is None
    assert w_twin.first is not None and where(w_twin.first)[:3] == (1, 0, "forward")


def test_a_shallow_copy_shares_the_hooks_and_reports_nothing():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, log_events=False) as w:
        train(model, opt, 1)
        layer = copy.copy(model[2])  # shares torch's hook dicts with model[2]
        assert layer._forward_hooks is model[2]._forward_hooks
        with torch.no_grad():
            assert torch.isnan(layer(torch.full((4, 16), float("nan")))).all()
        train(model, opt, 2)
    assert w.first is None and w.nonfinite_steps == 0
