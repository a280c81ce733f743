"""The ground truth finds each planted NaN, +inf and -inf where it was planted, without nand."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from tests.integrations.faults import VALUES, Fault, Planted, param_groups
from tests.integrations.truth import Finding, Truth

pytestmark = pytest.mark.parametrize("value", list(VALUES))


class Block(nn.Module):
    """Inline code between two children, as in a real block's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.inline = torch.zeros(())  # added to one element: 0 unless a test plants

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        h = h + torch.zeros_like(h).index_fill_(-1, torch.tensor([0]), 1.0) * self.inline
        return self.fc2(h)


class Tiny(nn.Module):
    """Two siblings read the same value (like q, k and v), then a nested block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.block = Block()
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        return self.head(self.block(self.a(h) * torch.sigmoid(self.b(h))))


def train(
    fault: Fault | None = None,
    steps: int = 4,
    accum: int = 1,
    x_value: tuple[int, float] | None = None,
    before_forward: Callable[[int, nn.Module], None] | None = None,
    before_update: Callable[[int, nn.Module], None] | None = None,
) -> Truth:
    """A plain loop over Tiny with the truth attached; returns the truth."""
    torch.manual_seed(0)
    model = Tiny()
    isolate = fault.where if fault is not None and fault.kind == "lr" else None
    opt = torch.optim.SGD(param_groups(model, isolate), lr=0.1)
    planted = Planted(fault, model)
    gen = torch.Generator().manual_seed(0)
    with Truth(model, opt) as truth:
        for step in range(steps):
            for micro in range(accum):
                planted.arm(step, micro)
                if before_forward is not None:
                    before_forward(step, model)
                x = torch.randn(3, 4, generator=gen)
                if x_value is not None and x_value[0] == step:
                    x[1, 2] = x_value[1]
                planted.loss(model(x).pow(2).mean()).backward()
            if before_update is not None:
                before_update(step, model)
            planted.before_update(opt, step)
            opt.step()
            opt.zero_grad()
            truth.end_step()
    return truth


def test_a_healthy_run_records_nothing(value):
    truth = train()
    assert truth.findings == [] and truth.first is None and truth.step == 4


def test_a_non_finite_input_is_found_as_input_data(value):
    assert train(x_value=(2, VALUES[value])).first == Finding(2, 0, "input", "", "data")


@pytest.mark.parametrize("where", ["fc", "a", "b", "block.fc2", "head"])
def test_a_non_finite_module_output_is_found_at_that_module(value, where):
    truth = train(Fault("forward", 1, where, value))
    assert truth.first == Finding(1, 0, "forward", where, "produced")


def test_a_value_made_inline_in_a_parent_is_blamed_on_the_parent(value):
    def before(step: int, model: nn.Module) -> None:
        model.block.inline.fill_(VALUES[value] if step == 1 else 0.0)

    truth = train(before_forward=before)
    assert truth.first == Finding(1, 0, "forward", "block", "produced")


@pytest.mark.parametrize("where", ["fc", "a", "b", "block", "block.fc1", "head"])
def test_a_non_finite_gradient_made_in_a_module_backward_is_blamed_on_that_module(value, where):
    # "a" and "b" read the same value: its gradient arrives summed from both,
    # so only the node that made the NaN tells which of the two it was.
    truth = train(Fault("backward", 2, where, value))
    assert truth.first == Finding(2, 0, "backward", where, "produced")


def test_a_non_finite_loss_factor_is_found_as_loss(value):
    assert train(Fault("loss", 3, value=value)).first == Finding(3, 0, "loss", "", "produced")


def test_a_learning_rate_blown_up_is_found_in_that_parameter_after_the_update(value):
    truth = train(Fault("lr", 1, "block.fc1.weight", value))
    assert truth.first == Finding(1, 0, "param", "block.fc1.weight", "produced")


def test_a_value_written_into_grad_is_found_as_grad(value):
    def before(step: int, model: nn.Module) -> None:
        if step == 2:
            model.a.bias.grad[3] = VALUES[value]

    assert train(before_update=before).first == Finding(2, 0, "grad", "a.bias", "produced")


def test_the_micro_step_of_an_accumulated_fault_is_recorded(value):
    truth = train(Fault("backward", 1, "block.fc1", value, micro=2), accum=3)
    assert truth.first == Finding(1, 2, "backward", "block.fc1", "produced")


def test_gradient_findings_of_an_iteration_without_an_update_are_dropped(value):
    # As a GradScaler does after an overflow: no optimizer.step(), nothing to report.
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    planted = Planted(Fault("backward", 0, "b", value), model)
    with Truth(model, opt) as truth:
        planted.arm(0)
        model(torch.randn(3, 4)).pow(2).mean().backward()
        assert truth.findings == [Finding(0, 0, "backward", "b", "produced")]
        truth.end_step()  # no opt.step(): skipped
    assert truth.findings == [] and truth.skipped == [0] and truth.step == 1
