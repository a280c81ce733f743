"""The rules of what finite gradients imply about one update, as pure functions.

No watch here: each rule is checked against what the real optimizer does.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nand.agent.detect.update_rules import (
    GroupRules,
    UpdateTerms,
    bound_after_update,
    buffer_after_update,
    state_follows,
    update_terms,
)


class MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize(
    ("make", "follows"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), True),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), True),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4), False),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=1e-4), True),  # no buffer
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=1.5), False),
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), True),
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.01), False),
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.01, decoupled_weight_decay=True), True),
        (lambda ps: torch.optim.AdamW(ps, weight_decay=0.1), True),
        (lambda ps: torch.optim.AdamW(ps, betas=(torch.tensor(0.9), torch.tensor(0.99))), False),
        (lambda ps: MyAdam(ps), False),
        (lambda ps: torch.optim.RMSprop(ps), False),
    ],
)
def test_which_optimizers_state_follows_from_finite_gradients(make, follows):
    assert state_follows(make(nn.Linear(2, 2).parameters())) is follows


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.0, 0.5), (0.95, 0.95)])
def test_adams_step_never_exceeds_its_bound_whatever_the_gradients(make, betas):
    torch.manual_seed(0)
    p = nn.Parameter(torch.zeros(512))
    opt = make([p], lr=1.0, betas=betas, weight_decay=0.0, amsgrad=False)
    terms = update_terms(opt, opt.param_groups[0])
    assert terms is not None
    _, shift = terms.bound(1.0, grad_max=math.inf)
    scales = [1e-30, 1e-6, 1.0, 1e6, 1e15]
    worst = 0.0
    for step in range(300):
        g = torch.randn(512) * scales[step % len(scales)]
        g[step % 512] = 1e18 if step % 7 == 0 else g[step % 512]  # spikes
        g[(step * 31) % 512] = 0.0
        before = p.detach().clone()
        p.grad = g
        opt.step()
        worst = max(worst, float((p.detach() - before).abs().max()))
    assert 0 < worst <= shift


def test_the_cached_group_rules_follow_every_change_of_the_hyperparameters():
    p = nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.01)
    group = opt.param_groups[0]
    rules = GroupRules(opt)

    def cached_bound() -> tuple[float, float] | None:
        terms, lr = rules.terms[0], group["lr"]
        return None if terms is None or not isinstance(lr, float) else terms.bound(lr, 2.0)

    def fresh_bound() -> tuple[float, float] | None:
        terms, lr = update_terms(opt, group), group["lr"]
        return None if terms is None or not isinstance(lr, float) else terms.bound(lr, 2.0)

    def agrees_with_a_fresh_derivation() -> bool:
        rules.update()
        return cached_bound() == fresh_bound() and (rules.follows == state_follows(opt))

    changes = [
        {},
        {"lr": 0.05},  # a schedule: no new derivation, the lr is applied per step
        {"weight_decay": 0.2},
        {"betas": (0.5, 0.6)},
        {"betas": (0.95, 0.9)},  # b1² >= b2: no bound
        {"betas": (torch.tensor(0.9), 0.999)},  # a tensor: not proven
        {"betas": (0.9, 0.999)},  # equal to the tensor's values, but proven again
        {"lr": torch.tensor(0.1)},  # a tensor lr: no bound
        {"lr": 0.1, "betas": [0.9, 0.999]},
    ]
    for change in changes:
        group.update(change)
        assert agrees_with_a_fresh_derivation(), change
    group["betas"][1] = 0.5  # the same list, changed in place: b1² >= b2 now
    assert agrees_with_a_fresh_derivation() and cached_bound() is None


@pytest.mark.parametrize(
    "make",
    [
        lambda groups: torch.optim.SGD(groups, lr=0.5, weight_decay=0.1),
        lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
        lambda groups: torch.optim.Adam(groups, lr=0.05, weight_decay=0.1),
        lambda groups: torch.optim.SGD(groups, lr=0.5, momentum=0.9),
        lambda groups: torch.optim.SGD(groups, lr=0.5, momentum=0.9, nesterov=True),
        lambda groups: torch.optim.SGD(groups, lr=0.5, momentum=0.5, dampening=0.3),
        lambda groups: torch.optim.SGD(groups, lr=0.5, momentum=0.9, weight_decay=0.1),
    ],
    ids=[
        "sgd",
        "adamw",
        "adam-coupled-decay",
        "momentum",
        "nesterov",
        "dampening",
        "momentum-decay",
    ],
)
def test_the_bound_after_each_update_holds_every_parameter_through_a_schedule(make):
    """Carried from step to step with no read, the bound never falls below the
    real max|p|, with two groups, growing parameters and a changing lr."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(8))
    opt = make([{"params": [a], "lr": 1.0}, {"params": [b]}])
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.97)
    start = b.detach().clone()
    bound = max(float(a.detach().abs().max()), float(b.detach().abs().max()))
    buffer = 0.0  # SGD's momentum buffers: none before the first update
    for step in range(60):
        a.grad = torch.randn(64) * (10.0 ** (step % 5 - 2))
        b.grad = torch.randn(8) - 3.0  # a steady push: the parameters grow
        grad_max = max(float(a.grad.norm()), float(b.grad.norm()))  # bounds every element
        terms = [update_terms(opt, group) for group in opt.param_groups]
        buffer = buffer_after_update(buffer, bound, terms, grad_max)
        after = bound_after_update(bound, terms, opt.param_groups, grad_max, buffer)
        assert after is not None
        opt.step()
        schedule.step()
        bound = after * (1 + 4 * torch.finfo(torch.float32).eps)  # the write's rounding
        assert max(float(a.detach().abs().max()), float(b.detach().abs().max())) <= bound, step
        buffers = [s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s]
        assert all(float(x.abs().max()) <= buffer * (1 + 1e-6) for x in buffers), step
    assert float((b.detach() - start).abs().max()) > 1.0  # (they did move)


def test_a_momentum_bound_needs_the_parameters_bound_only_with_weight_decay():
    plain = UpdateTerms(grow=0.0, per_grad=1.0, momentum=0.9)
    decayed = UpdateTerms(grow=0.1, per_grad=1.0, momentum=0.9)
    assert buffer_after_update(1.0, None, [plain], 2.0) == 0.9 + 2.0
    assert buffer_after_update(1.0, None, [decayed], 2.0) is None
    assert buffer_after_update(1.0, 10.0, [decayed], 2.0) == 0.9 + 2.0 + 1.0
    assert buffer_after_update(5.0, 10.0, [plain], 0.0) == 5.0  # never shrinks (a skipped step)


def test_no_bound_for_a_tensor_learning_rate_or_a_group_without_terms():
    p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q], "momentum": 1.5}], lr=0.1)
    terms = [update_terms(opt, group) for group in opt.param_groups]
    assert terms[0] is not None and terms[1] is None  # momentum >= 1: no bound
    assert bound_after_update(1.0, terms, opt.param_groups, 1.0) is None
    opt.param_groups.pop()
    assert bound_after_update(1.0, terms[:1], opt.param_groups, 1.0) == 1.1
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    assert bound_after_update(1.0, terms[:1], opt.param_groups, 1.0) is None


def test_adams_bound_ignores_an_infinite_gradient_bound():
    # Adam's step does not depend on the gradients' size: 0 * inf must not
    # turn the bound into NaN.
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=0.01)
    terms = [update_terms(opt, opt.param_groups[0])]
    after = bound_after_update(1.0, terms, opt.param_groups, math.inf)
    assert after is not None and math.isfinite(after) and after > 1.0
