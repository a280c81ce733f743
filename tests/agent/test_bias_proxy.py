"""Output gradients read through biases (``grads.BiasProxy``) blame as real probes do."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nand
from nand.agent.detect.grads import GradHooks
from nand.agent.detect.modules import module_table, proxy_bias
from tests.agent.models import VALUES, BackwardPlant, BadBackward, arm_at, mlp, train, where

#: The full mode's bias proxies (the light mode hooks no module): see tests/conftest.py.
pytestmark = pytest.mark.nand_mode("full")

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


# --- an MLP whose only backward probes are bias proxies ----------------------


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


def test_an_mlps_biases_each_get_one_hook_and_close_removes_them():
    model = mlp()
    biases = [model[i].bias for i in (0, 2, 4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt):
        assert all(len(b._backward_hooks or {}) == 1 for b in biases)  # one per bias
        train(model, opt, 2)
    assert not any(b._post_accumulate_grad_hooks or b._backward_hooks for b in biases)


@pytest.mark.parametrize("accum", [1, 3])
def test_bias_proxies_give_each_layers_gradient_figure(accum):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    arrivals: dict[int, list[float]] = {0: [], 2: [], 4: []}  # each micro-step's bias gradient
    for i, figures in arrivals.items():
        model[i].bias.register_hook(lambda g, figures=figures: figures.append(float(g.abs().max())))
    with nand.watch(model, opt) as w:
        train(model, opt, 3, accum=accum)
    window = w.flight_window()
    for step, figures in enumerate(window.grad_max_abs):
        by_module = dict(zip(window.modules, figures, strict=True))
        expected = [max(arrivals[i][step * accum : (step + 1) * accum]) for i in (0, 2, 4)]
        assert [by_module[name] for name in ("0", "2", "4")] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_gradient_made_non_finite_in_backward_is_blamed_on_what_ran_before_it(kind, monkeypatch):
    monkeypatch.setenv("NAND_REPLAYS", "0")  # the probes alone
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = _corrupt_gradient_into(model[2], (2, 1), VALUES[kind])
    with nand.watch(model, opt, mode="full") as w:
        train(model, opt, 4, accum=2, before=before)
    # Finite into the last Linear's output, not into the middle one's: what
    # ran between them (the last Linear's backward, the ReLU's) made it.
    assert where(w.first) == (2, 1, "backward", "4", "produced")


@pytest.mark.parametrize("kind", KINDS)
def test_the_replay_names_the_module_whose_backward_node_a_gradient_hook_ran_in(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = _corrupt_gradient_into(model[2], (2, 1), VALUES[kind])
    with nand.watch(model, opt) as w:
        train(model, opt, 4, accum=2, before=before)
    # A hook on the middle Linear's output runs before that Linear's backward
    # node, with it: the replay's op ran there (rerun/owners.py).
    assert where(w.first) == (2, 1, "backward", "2", "produced")
    assert w.first.op and w.first.reproduced


def test_a_non_finite_loss_gradient_is_blamed_on_the_loss():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(out: object, step: int) -> torch.Tensor:
        assert isinstance(out, torch.Tensor)
        return (BadBackward.apply(out, math.nan) if step == 1 else out).pow(2).mean()

    with nand.watch(model, opt) as w:
        train(model, opt, 3, loss_fn=loss_fn)
    assert where(w.first) == (1, 0, "loss", "", "produced")
