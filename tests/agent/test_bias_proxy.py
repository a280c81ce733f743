"""Output gradients read through biases (``grads.BiasProxy``) blame as real probes do."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nand
from nand.agent import hooks as hooks_module
from nand.agent.grads import GradHooks
from nand.agent.modules import module_table, proxy_bias
from tests.agent.models import VALUES, BackwardPlant, BadBackward, arm_at, mlp, train, where

KINDS = list(VALUES)


def test_an_mlp_registers_no_gradient_hook_per_step_yet_keeps_gradient_figures(monkeypatch):
    attached: list[torch.Tensor] = []
    real_attach = GradHooks.attach

    def attach(self: GradHooks, t: torch.Tensor) -> None:
        attached.append(t)
        real_attach(self, t)

    monkeypatch.setattr(GradHooks, "attach", attach)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 3)
    assert attached == []  # relus feed Linears; the Linears' gradients come from biases
    grads = dict(zip(w.flight_window().modules, w.flight_window().grad_max_abs[-1], strict=True))
    assert all(grads[name] is not None for name in ("0", "2", "4"))  # the Linears
    assert w.first is None


@pytest.mark.parametrize("kind", KINDS)
def test_clipping_after_backward_does_not_move_the_blame_to_the_loss(kind):
    # A NaN total norm makes clip_grad_norm_ multiply every gradient by NaN:
    # read at the step boundary, every bias would look bad and the first in
    # backward order (the loss) would be blamed. Read at accumulation, they are not.
    model = nn.Sequential(nn.Linear(8, 16), BackwardPlant(), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with nand.watch(model, opt) as w:
        for step in range(4):
            model[1].value = VALUES[kind] if step == 2 else None
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    assert where(w.first) == (2, 0, "backward", "1", "produced")


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation_labels_the_micro_step_of_a_backward_nan(kind):
    model = nn.Sequential(nn.Linear(8, 16), BackwardPlant(), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 4, accum=3, before=arm_at(model[1], 2, VALUES[kind], micro=1))
    assert where(w.first) == (2, 1, "backward", "1", "produced")


class Twice(nn.Module):
    """One Linear called twice, a backward plant after each call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.first = BackwardPlant()
        self.second = BackwardPlant()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.fc(torch.tanh(self.first(self.fc(x)))))


@pytest.mark.parametrize("plant", ["first", "second"])
def test_a_module_called_twice_keeps_its_backward_blame_for_either_call(plant):
    # The first call's gradient is read from the bias, the second call's by a
    # real probe; either way the plant whose backward made the NaN is named.
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        train(model, opt, 4, before=arm_at(getattr(model, plant), 2, float("nan")))
    assert where(w.first) == (2, 0, "backward", plant, "produced")


def test_which_modules_read_their_gradient_from_the_bias():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(
        nn.Linear(4, 4),  # 0: yes
        nn.Linear(4, 4, bias=False),  # 1: no bias
        nn.Linear(4, 4),  # 2: frozen bias
        MyLinear(4, 4),  # 3: a subclass may use its bias otherwise
        nn.LayerNorm(4),  # 4: yes
        nn.Conv1d(4, 4, 1),  # 5: yes
        nn.Linear(4, 4),  # 6: allow-listed
        nn.Linear(4, 4),  # 7: its bias tied to 0's
        nn.BatchNorm1d(4),  # 8: yes
    )
    model[7].bias = model[0].bias
    model[2].bias.requires_grad_(False)
    infos = module_table(model, False, ("6",))
    chosen = {infos[m].name for m in proxy_bias(model, infos)}
    assert chosen == {"4", "5", "8"}  # 0 and 7 share a bias: neither


# --- an exact Sequential whose only backward probes are bias proxies ---------


def _together(enabled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read the chain's biases with one hook (the default) or one hook each."""
    if not enabled:
        monkeypatch.setattr(hooks_module, "_proxy_chain", lambda *args: None)


def _corrupt_gradient_into(module: nn.Module, at: tuple[int, int], value: float) -> Callable:
    """A user's hook makes one element of the gradient arriving at ``module``'s output ``value``."""
    armed = {"now": False}

    def corrupt(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    def forward_hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if armed["now"]:
            output.register_hook(corrupt)

    module.register_forward_hook(forward_hook)

    def before(step: int, micro: int) -> None:
        armed["now"] = (step, micro) == at

    return before


def test_an_mlps_biases_are_read_by_one_hook_and_close_removes_it():
    model = mlp()
    biases = [model[i].bias for i in (0, 2, 4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt):
        assert len(biases[0]._post_accumulate_grad_hooks or {}) == 1  # the first Linear's
        assert not any(b._post_accumulate_grad_hooks for b in biases[1:])
        assert not any(b._backward_hooks for b in biases)  # no hook per bias
        train(model, opt, 2)
    assert not any(b._post_accumulate_grad_hooks or b._backward_hooks for b in biases)


def test_a_chain_with_another_backward_probe_keeps_one_hook_per_bias():
    model = nn.Sequential(nn.Linear(8, 16), BackwardPlant(), nn.Tanh(), nn.Linear(16, 4))
    with nand.watch(model):
        assert all(len(model[i].bias._backward_hooks or {}) == 1 for i in (0, 3))
        assert not model[0].bias._post_accumulate_grad_hooks


@pytest.mark.parametrize("accum", [1, 3])
def test_biases_read_together_give_each_layers_gradient_figure(accum):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    readings: list[list[float]] = []  # after each micro-step's backward, per Linear

    def read_biases(*_: object) -> None:
        readings.append([float(model[i].bias.grad.abs().max()) for i in (0, 2, 4)])

    def before(step: int, micro: int) -> None:
        if micro > 0:
            read_biases()  # the gradient accumulated so far

    opt.register_step_pre_hook(read_biases)
    with nand.watch(model, opt) as w:
        train(model, opt, 3, accum=accum, before=before)
    window = w.flight_window()
    for step, figures in enumerate(window.grad_max_abs):
        by_module = dict(zip(window.modules, figures, strict=True))
        # Read from .grad once accumulated: each micro-step's sum so far.
        this_step = readings[step * accum : (step + 1) * accum]
        expected = [max(r) for r in zip(*this_step, strict=True)]
        assert [by_module[name] for name in ("0", "2", "4")] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("together", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_a_gradient_made_non_finite_in_backward_is_blamed_alike_either_way(
    kind, together, monkeypatch
):
    _together(together, monkeypatch)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = _corrupt_gradient_into(model[2], (2, 1), VALUES[kind])
    with nand.watch(model, opt) as w:
        train(model, opt, 4, accum=2, before=before)
    # Finite into the last Linear's output, not into the middle one's: what
    # ran between them (the last Linear's backward, the ReLU's) made it.
    assert where(w.first) == (2, 1, "backward", "4", "produced")


@pytest.mark.parametrize("together", [True, False])
def test_a_non_finite_loss_gradient_is_blamed_on_the_loss_either_way(together, monkeypatch):
    _together(together, monkeypatch)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(out: object, step: int) -> torch.Tensor:
        assert isinstance(out, torch.Tensor)
        return (BadBackward.apply(out, math.nan) if step == 1 else out).pow(2).mean()

    with nand.watch(model, opt) as w:
        train(model, opt, 3, loss_fn=loss_fn)
    assert where(w.first) == (1, 0, "loss", "", "produced")
