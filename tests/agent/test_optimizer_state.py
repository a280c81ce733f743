"""Optimizer state: checked unless finite gradients make it finite by construction."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import nand
from tests.agent.models import mlp, train


@contextlib.contextmanager
def counting_norms() -> Iterator[list[int]]:
    """How many tensors each ``_foreach_norm`` call gets, in call order."""
    counts: list[int] = []
    real = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        counts.append(len(tensors))
        return real(tensors, *args, **kwargs)

    torch._foreach_norm = counting  # type: ignore[assignment]
    try:
        yield counts
    finally:
        torch._foreach_norm = real  # type: ignore[assignment]


def normed_per_step(opt: torch.optim.Optimizer, model: nn.Module, steps: int) -> list[int]:
    """How many tensors nand hands to ``_foreach_norm`` at each step."""
    per_step = []
    with nand.watch(model, opt), counting_norms() as counts:
        for _ in range(steps):
            before = sum(counts)
            train(model, opt, 1)
            per_step.append(sum(counts) - before)
    return per_step


def test_adam_state_is_implied_finite_by_finite_gradients_and_not_read():
    model = mlp()  # 6 parameters
    counts = normed_per_step(torch.optim.AdamW(model.parameters(), lr=1e-3), model, 4)
    # step 0: gradients; step 1: and the parameters, once; no state, ever
    assert counts == [6, 12, 6, 6]


def test_the_state_of_an_optimizer_nand_does_not_reason_about_is_read_every_step():
    model = mlp()
    counts = normed_per_step(torch.optim.RMSprop(model.parameters(), lr=1e-3), model, 3)
    assert counts == [6, 18, 18]  # + square_avg of each parameter


def test_adam_state_overflowing_from_a_huge_finite_gradient_is_reported_as_optimizer_state():
    # g = 1e21 is finite, (1 - b2) * g*g is not: exp_avg_sq becomes +inf while
    # the update m / sqrt(v) is 0 and the weights stay finite. The gradients'
    # 2-norm overflowed (a suspect, verified finite), so that step's state is
    # not taken as implied finite: it is read, and reported.
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = [0]

    def huge_gradient(optimizer, args, kwargs):  # registered first: runs before nand's
        if steps[0] == 2:
            model[0].weight.grad[0, 0] = 1e21
        steps[0] += 1

    opt.register_step_pre_hook(huge_gradient)
    with nand.watch(model, opt) as w:
        train(model, opt, 4)
    assert w.first is not None
    assert (w.first.step, w.first.phase, w.first.module) == (
        2,
        "optimizer_state",
        "0.weight:exp_avg_sq",
    )
    assert (w.first.posinf, w.first.nan) == (1, 0)


def test_adam_state_loaded_from_a_checkpoint_is_read_again():
    # +inf in exp_avg_sq leaves the weights finite (m / inf = 0): only a
    # check of the state itself can see it.
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nand.watch(model, opt) as w:
        train(model, opt, 2)
        saved = opt.state_dict()
        saved["state"][0]["exp_avg_sq"][0, 0] = float("inf")
        opt.load_state_dict(saved)
        train(model, opt, 2)
    assert w.first is not None
    assert (w.first.step, w.first.phase, w.first.module) == (
        2,
        "optimizer_state",
        "0.weight:exp_avg_sq",
    )


def test_float16_state_is_read_every_step():
    # In float16, g*g overflows for |g| > 256 while the gradient's norm is
    # still finite: the argument does not hold, the state is read.
    model = nn.Sequential(nn.Linear(8, 4)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    x = torch.randn(4, 8, dtype=torch.float16)
    with nand.watch(model, opt), counting_norms() as counts:
        for _ in range(3):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert counts == [2, 8, 8]  # grads; then grads, params, exp_avg, exp_avg_sq


# --- parameters implied finite --------------------------------------------------


def test_sgd_parameters_are_read_once_then_carried_by_a_bound():
    model = mlp()
    counts = normed_per_step(
        torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01), model, 60
    )
    assert counts == [6, 12] + [6] * 58  # the bound's rounding slack does not force re-reads


class TwoScalars(nn.Module):
    """Two one-element parameters: a 2-norm is max|p|, so the bound is tight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + 3 * x * self.b


@pytest.mark.parametrize(
    "make",
    [
        lambda groups: torch.optim.SGD(groups, lr=0.5, weight_decay=0.1),
        lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
    ],
    ids=["sgd", "adamw"],
)
def test_the_carried_bound_holds_every_parameter_through_a_schedule(make):
    """The bound _plan carries (UpdateTerms.bound per group, written out) is
    never below the parameters' real max|p| while they grow, with two groups
    and a learning rate that changes every step."""
    model = TwoScalars()
    opt = make([{"params": [model.a], "lr": 1.0}, {"params": [model.b]}])
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.97)
    carried = 0
    with nand.watch(model, opt) as w:
        for _ in range(40):
            model(torch.ones(1)).sum().backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
            bound = w._opt._bound
            if bound is not None:
                carried += 1
                assert max(abs(model.a.item()), abs(model.b.item())) <= bound
    assert carried >= 30  # carried, not read again at every step
    assert abs(model.a.item()) > 5  # (the parameters did grow)


def test_sgd_with_momentum_carries_a_bound_and_reads_neither_state_nor_parameters():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # The parameters once (no bound yet); then the momentum buffers' bound,
    # carried from the gradients, bounds each step and nothing else is read.
    assert normed_per_step(opt, model, 5) == [6, 12, 6, 6, 6]


def test_sgd_momentum_buffers_loaded_from_a_checkpoint_are_read_before_trusted():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, 2)  # momentum buffers to save
    saved = opt.state_dict()
    per_step = []
    with nand.watch(model, opt), counting_norms() as counts:
        for step in range(5):
            if step == 2:
                opt.load_state_dict(saved)
            before = sum(counts)
            train(model, opt, 1)
            per_step.append(sum(counts) - before)
    # Buffers nand did not see made: read with the parameters once (18), then
    # bounded (6). Loaded at step 2: read again once, with the parameters, at
    # the next boundary (the update of step 2 used them), then bounded again.
    assert per_step == [6, 18, 6, 18, 6]


def test_a_hyperparameter_changed_mid_run_is_taken_into_account():
    # Coupled weight decay added to SGD with momentum: the momentum buffer is
    # no longer implied by the gradients, it is read from the next step on.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_step = []
    with nand.watch(model, opt), counting_norms() as counts:
        for step in range(5):
            if step == 2:
                opt.param_groups[0]["weight_decay"] = 1e-4
            before = sum(counts)
            train(model, opt, 1)
            per_step.append(sum(counts) - before)
    # From then on the momentum buffers are read (+6) and, with no bound on
    # them carried, the parameters too.
    assert per_step == [6, 12, 6, 18, 18]


def test_parameter_groups_added_and_removed_mid_run_keep_the_watch_on():
    model = mlp()
    first, *rest = list(model.parameters())
    opt = torch.optim.SGD([first], lr=0.1)
    with nand.watch(model, opt) as w:
        train(model, opt, 3)
        opt.add_param_group({"params": rest, "lr": 0.05})  # unfreezing the rest
        train(model, opt, 3)
        opt.param_groups.pop()
        train(model, opt, 3)
        assert not w._guard.off and w.step == 9 and w.first is None
        assert w._opt._bound is not None  # carried again after each change


def test_a_learning_rate_that_could_overflow_the_parameters_makes_nand_read_them():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    with nand.watch(model, opt), counting_norms() as counts:
        for step in range(5):
            opt.param_groups[0]["lr"] = 1e38 if step == 3 else 0.1
            before = sum(counts)
            train(model, opt, 1)
            per_step.append(sum(counts) - before)
    # lr * |g| no longer far below float32's limit after step 3: read at step 4
    assert per_step == [6, 12, 6, 6, 12]
