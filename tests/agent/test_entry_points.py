"""Entry points (``detect/entry.py``): a module of the watched model called
while none of its modules runs gets its inputs checked as the data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nand
from tests.agent.models import VALUES, Net, where


def train_parts(net: Net, bad_step: int | None, value: float, steps: int = 4) -> nand.Watch:
    """Calls ``net.block`` and then ``net.head`` from the loop, never ``net``;
    at ``bad_step`` the loop's own code puts ``value`` into what ``head`` gets."""
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    with nand.watch(net, opt, log_events=False) as w:
        for step in range(steps):
            h = net.block(torch.randn(4, 8, generator=gen))
            if step == bad_step:
                h = h.clone()
                h[1, 1] = value  # outside every module
            net.head(h).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return w


@pytest.mark.parametrize("kind", list(VALUES))
def test_a_leaf_called_from_the_loop_is_an_entry_point_whose_non_finite_input_is_data(kind):
    w = train_parts(Net(), bad_step=2, value=VALUES[kind])
    assert where(w.first) == (2, 0, "input", "head", "data")


def test_a_loop_calling_a_model_s_parts_with_finite_values_reports_nothing():
    w = train_parts(Net(), bad_step=2, value=1.0)
    assert w.first is None and w.events == [] and w.step == 4


class Flaky(nn.Module):
    """Raises in its forward once, as an out-of-memory error a loop retries would."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.fail = False
            raise RuntimeError("out of memory")
        return self.fc(x)


def test_an_exception_in_a_forward_leaves_no_module_counted_as_running():
    model = nn.ModuleDict({"flaky": Flaky(), "head": nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, log_events=False) as w:
        for step in range(3):
            x = torch.randn(2, 8)
            try:
                x = model["flaky"](x)
            except RuntimeError:
                x = model["flaky"](x)  # the retry
            if step == 1:
                x = x / 0.0  # the loop's code, between two parts
            model["head"](x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert where(w.first) == (1, 0, "input", "head", "data")
