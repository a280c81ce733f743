"""Structures, ignored tensors, false alarms that must not be, and the headroom warning."""

from __future__ import annotations

import logging
from collections import OrderedDict

import pytest
import torch
from torch import nn

import nand
from tests.agent.models import VALUES, Net, Plant, train


class DictOut(nn.Module):
    """Returns a ModelOutput-like OrderedDict with a float, an int and a bool tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.value: float | None = None

    def forward(self, x):
        logits = self.fc(x)
        if self.value is not None:
            logits = logits.clone()
            logits[0, 1] = self.value
        return OrderedDict(logits=logits, ids=torch.arange(4), mask=torch.ones(4, dtype=torch.bool))


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = DictOut()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        out = self.inner(x)
        return (self.head(out["logits"]), out["ids"])


@pytest.mark.parametrize("kind", list(VALUES))
def test_a_non_finite_value_in_a_dict_output_slot_is_found(kind):
    model = Wrapper()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def before(step, micro):
        model.inner.value = VALUES[kind] if step == 2 else None

    with nand.watch(model, opt) as w:
        train(model, opt, 4, before=before, loss_fn=lambda out, s: out[0].pow(2).mean())
    e = w.first
    assert (e.step, e.phase, e.module, e.cause) == (2, "forward", "inner", "produced")
    assert e.shape == [4, 4]


def test_a_healthy_run_with_unused_frozen_and_integer_parts_reports_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="nand")
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with nand.watch(model, opt) as w:
        train(model, opt, 20, loss_fn=lambda out, s: out.logits.pow(2).mean())
    assert w.first is None and not [r for r in caplog.records if r.name == "nand"]
    flight = w.flight_window()
    unused = flight.modules.index("unused")
    assert all(row[unused] is None for row in flight.act_max_abs)


def test_a_2_norm_overflow_of_finite_gradients_is_not_reported():
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nand.watch(model, opt) as w:
        model(torch.randn(2, 8)).sum().backward()
        model.weight.grad.fill_(1e30)  # finite; its float32 2-norm is inf
        assert not torch.isfinite(torch.linalg.vector_norm(model.weight.grad))
        opt.step()
    assert w.first is None


def test_values_near_the_dtype_limit_warn_once_and_are_never_an_event(caplog):
    class Big(nn.Module):
        def forward(self, x):
            # 50000 whatever the Linear's random init gives (fp16 max is 65504)
            return x.half().clamp(-1, 1) * 0.0 + 50000.0

    model = nn.Sequential(nn.Linear(8, 8), Big(), Plant())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    caplog.set_level(logging.WARNING, logger="nand")
    with nand.watch(model, opt) as w:
        for _ in range(3):
            x = torch.ones(2, 8)
            out = model(x).float()
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    messages = [r.getMessage() for r in caplog.records if r.name == "nand"]
    assert w.first is None
    assert len(messages) == 1 and "overflow headroom" in messages[0] and "float16" in messages[0]


@pytest.mark.parametrize("kind", list(VALUES))
def test_without_an_optimizer_each_root_call_is_a_step(kind):
    model = nn.Sequential(nn.Linear(8, 8), Plant(), nn.Linear(8, 2))
    with nand.watch(model) as w:
        for step in range(4):
            model[1].value = VALUES[kind] if step == 2 else None
            model(torch.randn(2, 8)).sum().backward()
    assert (w.first.step, w.first.phase, w.first.module) == (2, "forward", "1")
    assert w.step == 4


def test_an_inline_minus_inf_attention_mask_passed_to_a_child_is_not_an_incident():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, mask):
            scores = self.fc(x) @ x.transpose(-2, -1) + mask
            return torch.softmax(scores, dim=-1) @ x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            mask = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf")), diagonal=1)
            for block in self.blocks:
                x = block(x, mask)
            return x

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nand.watch(model, opt) as w:
        train(model, opt, 3, inputs=lambda step: ((torch.randn(2, 5, 8),), {}))
    assert w.first is None


def test_inputs_changed_by_a_module_own_pre_hook_are_that_module_s():
    from tests.agent.models import BadBackward

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    armed = [False]

    def poison(module, args):  # a user's pre-hook, part of model[1]'s call
        return (BadBackward.apply(args[0], float("nan")),) if armed[0] else None

    model[1].register_forward_pre_hook(poison)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def before(step, micro):
        armed[0] = step == 2

    with nand.watch(model, opt) as w:
        train(model, opt, 4, before=before)
    assert (w.first.step, w.first.phase, w.first.module) == (2, "backward", "1")


class SparseBag(nn.Module):
    """An embedding with sparse gradients (no ``_foreach_norm`` kernel) before a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.fc = nn.Linear(8, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_sparse_gradients_are_left_out_and_the_dense_ones_still_checked(caplog):
    model = SparseBag()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="nand"), nand.watch(model, opt) as w:
        for step in range(4):
            model(torch.randint(0, 10, (4, 3))).pow(2).mean().backward()
            if step == 2:
                model.fc.weight.grad[0, 0] = float("nan")
            opt.step()
            opt.zero_grad()
    assert "internal error" not in caplog.text  # nand stayed on
    assert (w.first.step, w.first.phase, w.first.module) == (2, "grad", "fc.weight")


def test_parameter_norms_record_no_autograd_graph(monkeypatch):
    # The optimizer's hooks run outside its no_grad: a norm of a parameter
    # itself would build a graph node every step.
    outputs: list[torch.Tensor] = []
    real = torch._foreach_norm

    def spy(tensors, *args, **kwargs):
        out = real(tensors, *args, **kwargs)
        outputs.extend(out)
        return out

    monkeypatch.setattr(torch, "_foreach_norm", spy)
    model = nn.Sequential(nn.Linear(8, 4))  # train() feeds 8 features
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    with nand.watch(model, opt):
        train(model, opt, 3)
    # 2 gradients a step, the 2 parameters from the second step on and at
    # close, with the 2 momentum buffers (weight decay: no bound, read them)
    assert len(outputs) == 2 + 4 + 6 + 6
    assert not any(t.requires_grad for t in outputs)


@pytest.mark.nand_mode("full")  # the full mode's per-layer telemetry
def test_the_root_s_gradient_column_never_holds_its_input_data():
    # The flight recorder's grad_max_abs of a module is the gradient flowing
    # out of it. The root's input data (a million, here) and the gradient
    # arriving at its output (1/16, a mean of 16 values) are probed at the
    # root's place in the table; the input is no gradient, so the root's
    # column holds at most that gradient, measured by a plain tensor hook.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    arriving: list[float] = []
    with nand.watch(model, opt) as w:
        for _ in range(2):
            out = model(torch.randn(4, 8) * 1e6)
            out.register_hook(lambda g: arriving.append(g.abs().max().item()))
            out.mean().backward()
            opt.step()
            opt.zero_grad()
        window = w.flight_window()
    assert arriving == [1 / 16, 1 / 16]
    root = window.modules.index("")
    assert all(row[root] in (None, 1 / 16) for row in window.grad_max_abs)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_an_optimizer_step_with_nothing_probed_is_healthy_and_the_watch_stays_on(policy, caplog):
    # No forward, no backward: every .grad is None, nothing was probed, the
    # window is empty. Nothing went non-finite anywhere: no policy acts, and
    # a fault planted afterwards is still found where it was made.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Plant(), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    caplog.set_level(logging.WARNING, logger="nand")
    with nand.watch(model, opt, on_nonfinite=policy) as w:
        train(model, opt, 2)
        opt.zero_grad()
        opt.step()  # step 2: nothing to read
        opt.step()  # step 3
        assert w.step == 4 and w.first is None
        said = [r.getMessage() for r in caplog.records if r.name == "nand"]
        assert not [m for m in said if "skipped" in m or "internal error" in m]
        model[1].value = float("nan")
        try:
            train(model, opt, 1)  # step 4
        except nand.NonFiniteError:
            assert policy == "raise"
    assert w.first is not None
    assert (w.first.step, w.first.phase, w.first.module) == (4, "forward", "1")
