"""Each fault planted at a known step gives the exact first event."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nand
from nand.agent.detect import param_cache
from tests.agent.models import (
    VALUES,
    BackwardPlant,
    Net,
    Plant,
    arm_at,
    mlp,
    train,
    where,
    write_grad,
)

pytestmark = pytest.mark.parametrize("kind", list(VALUES))


def test_non_finite_input_data_is_reported_as_input_with_cause_data(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def inputs(step: int):
        x = torch.randn(4, 8)
        if step == 3:
            x[1, 2] = VALUES[kind]
        return (x,), {}

    with nand.watch(model, opt) as w:
        train(model, opt, 5, inputs=inputs)
    assert where(w.first) == (3, 0, "input", "", "data")


def test_non_finite_in_a_nested_keyword_input_is_found(kind):
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)

    def inputs(step: int):
        bias = torch.zeros(8)
        if step == 2:
            bias[3] = VALUES[kind]
        return (torch.randn(4, 8),), {"extra": {"bias": [bias]}}

    with nand.watch(model, opt) as w:
        train(model, opt, 4, inputs=inputs, loss_fn=lambda out, s: out.logits.pow(2).mean())
    assert where(w.first) == (2, 0, "input", "", "data")
    assert "extra" in w.first.message


def test_the_first_module_producing_a_non_finite_output_is_blamed(kind):
    model = mlp(plant_after=2)  # Linear, ReLU, Linear, Plant, ReLU, Linear
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 6, before=arm_at(model[3], 4, VALUES[kind]))
    if kind == "-inf" and w.settings.mode == "light":  # relu(-inf) = 0: see test_light_tier
        assert w.first is None
        return
    assert where(w.first) == (4, 0, "forward", "3", "produced")
    assert w.first.module_type == "Plant"
    assert w.first.shape == [4, 16] and w.first.dtype == "float32"


def test_inline_code_in_a_parent_forward_is_blamed_on_the_parent(kind):
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)

    def before(step: int, micro: int) -> None:
        model.block.inline_value = VALUES[kind] if step == 1 else None

    with nand.watch(model, opt) as w:
        train(model, opt, 3, before=before, loss_fn=lambda out, s: out.logits.pow(2).mean())
    assert where(w.first) == (1, 0, "forward", "block", "produced")
    assert w.first.module_type == "Block"


def test_a_non_finite_loss_from_finite_outputs_is_reported_as_loss(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(out, step):
        loss = out.pow(2).mean()
        return loss * VALUES[kind] if step == 2 else loss

    with nand.watch(model, opt) as w:
        train(model, opt, 4, loss_fn=loss_fn)
    assert where(w.first) == (2, 0, "loss", "", "produced")


def test_a_nan_made_only_in_a_custom_backward_is_blamed_on_that_module(kind):
    layers = [nn.Linear(8, 16), BackwardPlant(), nn.ReLU(inplace=True), nn.Linear(16, 4)]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 5, before=arm_at(model[1], 3, VALUES[kind]))
    assert where(w.first) == (3, 0, "backward", "1", "produced")
    assert w.first.module_type == "BackwardPlant"


@pytest.mark.nand_mode("full")  # relu's backward hides the NaN gradient from all but a module probe
def test_where_log_backward_nan_is_found_in_backward_not_forward(kind):
    class SafeLog(nn.Module):
        def forward(self, x):
            return torch.where(x > 0, torch.log(x), torch.zeros_like(x))

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), SafeLog(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: weights stay, only grads matter
    with nand.watch(model, opt) as w:
        train(model, opt, 3)
    # ReLU makes exact zeros; log'(0) * 0 = NaN in backward only, from the first step.
    assert where(w.first) == (0, 0, "backward", "2", "produced")


@pytest.mark.nand_mode("full")  # relu's backward hides the NaN gradient from all but a module probe
def test_a_relu_hands_its_gradient_probe_through_finite_preserving_modules(kind):
    class SafeLog(nn.Module):
        def forward(self, x):
            return torch.where(x > 0, torch.log(x), torch.zeros_like(x))

    # tanh(0) == 0: the NaN log'(0) * 0 makes passes tanh's backward and
    # vanishes in relu's; the probe on relu's output, deferred through tanh
    # to its consumer, sees it.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Tanh(), SafeLog(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nand.watch(model, opt) as w:
        train(model, opt, 2)
    assert where(w.first) == (0, 0, "backward", "3", "produced")


@pytest.mark.nand_mode("full")  # the full mode's gradient probes and per-layer telemetry
def test_a_relu_feeding_a_linear_gets_no_gradient_probe(kind):
    # A Linear's backward cannot make a NaN exactly where the relu cut: the
    # gradient between them is not probed (the Linears' own gradients are).
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 3)
    window = w.flight_window()
    grads = dict(zip(window.modules, window.grad_max_abs[-1], strict=True))
    assert grads["1"] is None and grads["2"] is None
    assert grads["0"] is not None and grads["3"] is not None
    assert w.first is None


@pytest.mark.nand_mode("full")  # relu's backward hides the NaN gradient from all but a module probe
def test_an_inline_relu_is_not_probed_again_but_a_gradient_it_hides_is_found(kind):
    class SafeLog(nn.Module):
        def forward(self, x):
            return torch.where(x > 0, torch.log(x), torch.zeros_like(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.log = nn.Linear(8, 16), SafeLog()

        def forward(self, x):
            return self.log(torch.relu(self.fc(x)))  # relu inline, between two children

    model = nn.Sequential(Block(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nand.watch(model, opt) as w:
        train(model, opt, 2)
    # log'(0) * 0 = NaN where relu cut, and relu's backward zeroes exactly
    # there: only the probe on the inline relu's gradient sees it.
    assert where(w.first) == (0, 0, "backward", "0.log", "produced")
    block = w.flight_window().modules.index("0")
    assert all(row[block] is None for row in w.flight_window().act_max_abs)


def test_inline_code_changing_a_child_output_in_place_before_a_relu_is_blamed_on_the_parent(
    kind,
):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
            self.value: float | None = None

        def forward(self, x):
            h = self.fc(x)
            if self.value is not None:
                h.mul_(self.value)  # inline, in place, on the probed output
            return self.out(torch.relu(h))

    model = nn.Sequential(Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 4, before=arm_at(model[0], 2, VALUES[kind]))
    assert where(w.first) == (2, 0, "forward", "0", "produced")


def test_an_inline_gelu_of_an_allowed_minus_inf_is_probed_and_blamed_on_the_parent(kind):
    class Mask(nn.Module):
        def forward(self, x):
            return x.masked_fill(torch.ones_like(x, dtype=torch.bool).triu(1), float("-inf"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.mask, self.out = nn.Linear(8, 8), Mask(), nn.Linear(8, 4)

        def forward(self, x):
            return self.out(nn.functional.gelu(self.mask(self.fc(x))))  # gelu(-inf) = NaN

    model = nn.Sequential(Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nand.watch(model, opt, allow_nonfinite=["*mask"]) as w:
        train(model, opt, 2)
    assert where(w.first) == (0, 0, "forward", "0", "produced")


def test_a_non_finite_gradient_written_into_grad_is_reported_as_grad(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 4, after_backward=write_grad(model[2].weight, 2, VALUES[kind]))
    assert where(w.first) == (2, 0, "grad", "2.weight", "produced")
    assert w.first.module_type == "Linear"
    counts = {"nan": w.first.nan, "+inf": w.first.posinf, "-inf": w.first.neginf}
    assert counts[kind] == 1 and sum(counts.values()) == 1


def corrupt_after_step(opt, at_step, fn):
    """An optimizer post-hook registered before nand's: as if the update made it."""
    count = [0]

    def hook(optimizer, args, kwargs):
        if count[0] == at_step:
            with torch.no_grad():
                fn()
        count[0] += 1

    opt.register_step_post_hook(hook)


def test_a_non_finite_update_is_reported_as_param_of_that_step(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    corrupt_after_step(opt, 1, lambda: model[4].bias.data.__setitem__(1, VALUES[kind]))
    with nand.watch(model, opt) as w:
        train(model, opt, 4)
    assert where(w.first) == (1, 0, "param", "4.bias", "produced")


def test_optimizer_state_going_non_finite_is_reported_as_optimizer_state(kind):
    # RMSprop: an optimizer nand does not reason about, its state is checked
    # after every update.
    model = mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    state = lambda: opt.state[model[0].weight]["square_avg"]  # noqa: E731
    corrupt_after_step(opt, 2, lambda: state().__setitem__((0, 0), VALUES[kind]))
    with nand.watch(model, opt) as w:
        train(model, opt, 4)
    assert where(w.first) == (2, 0, "optimizer_state", "0.weight:square_avg", "produced")


def test_a_param_going_bad_at_the_last_step_is_found_at_close(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    corrupt_after_step(opt, 2, lambda: model[0].weight.data.__setitem__((0, 0), VALUES[kind]))
    with nand.watch(model, opt) as w:
        train(model, opt, 3)
    assert where(w.first) == (2, 0, "param", "0.weight", "produced")


def test_a_reused_module_reports_which_call_went_bad(kind):
    class CountingPlant(Plant):
        """Armed on one call (0-based) of the forward pass only."""

        def __init__(self):
            super().__init__()
            self.calls, self.armed_call = 0, -1

        def forward(self, x):
            self.value = VALUES[kind] if self.calls == self.armed_call else None
            self.calls += 1
            return super().forward(x)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.plant = CountingPlant()

        def forward(self, x):
            return self.plant(self.fc(self.plant(self.fc(x))))

    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def before(step, micro):
        model.plant.calls = 0
        model.plant.armed_call = 1 if step == 2 else -1

    with nand.watch(model, opt) as w:
        train(model, opt, 4, before=before)
    assert where(w.first) == (2, 0, "forward", "plant", "produced")
    assert w.first.call == 1 and "call 2 of this module" in w.first.message


def test_gradient_accumulation_labels_the_micro_step(kind):
    model = mlp(plant_after=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 4, accum=3, before=arm_at(model[1], 2, VALUES[kind], micro=2))
    if kind == "-inf" and w.settings.mode == "light":  # relu(-inf) = 0: see test_light_tier
        assert w.first is None
        return
    assert where(w.first) == (2, 2, "forward", "1", "produced")


def test_an_allow_listed_module_may_emit_minus_inf_but_not_nan(kind):
    class Mask(nn.Module):
        def forward(self, x):
            return x.masked_fill(torch.ones_like(x, dtype=torch.bool).triu(1), float("-inf"))

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.mask = Mask()
            self.plant = Plant()

        def forward(self, x):
            return self.plant(torch.softmax(self.mask(self.fc(x)), -1))

    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt, allow_nonfinite=["mask"]) as w:
        train(model, opt, 4, before=arm_at(model.plant, 3, VALUES[kind]))
    assert where(w.first) == (3, 0, "forward", "plant", "produced")


def test_the_event_says_what_the_values_looked_like(kind):
    model = mlp(plant_after=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 2, before=arm_at(model[1], 1, VALUES[kind]))
    if kind == "-inf" and w.settings.mode == "light":  # relu(-inf) = 0: see test_light_tier
        assert w.first is None
        return
    e = w.first
    text = {"nan": "NaN", "+inf": "+inf", "-inf": "-inf"}[kind]
    assert text in e.message and "1 (Plant)" in e.message and "step 1" in e.message
    if kind == "nan":
        assert math.isnan(e.max)
    else:
        assert (e.max if kind == "+inf" else e.min) == VALUES[kind]


@pytest.mark.parametrize("large", [False, True], ids=["read-with-grads", "read-after-update"])
def test_param_and_state_findings_from_either_launch(kind, large, monkeypatch):
    # Small models' params and state ride in the next pre-hook's launch; large
    # ones get a post-hook that launches right after the update.
    monkeypatch.setattr(param_cache, "FUSE_BELOW_BYTES", 0 if large else 1 << 30)
    model = mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    corrupt_after_step(opt, 2, lambda: model[2].weight.data.__setitem__((0, 0), VALUES[kind]))
    with nand.watch(model, opt) as w:
        train(model, opt, 4)
        assert len(opt._optimizer_step_post_hooks) == 1 + large  # corrupt_after_step's, nand's
    assert where(w.first) == (2, 0, "param", "2.weight", "produced")
    assert len(opt._optimizer_step_post_hooks) == 1  # nand's is gone
