"""Exact ``nn.Sequential`` chains: finite-preserving children go unhooked, blame unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import nand
from nand.agent.detect.modules import Chains, module_table
from tests.agent.models import VALUES, mlp, train, where

#: The full mode's hook placement (the light mode hooks no module): see tests/conftest.py.
pytestmark = pytest.mark.nand_mode("full")


class SafeLog(nn.Module):
    """A leaf whose backward is not benign: NaN where x == 0, exactly where a relu cut."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


class MySequential(nn.Sequential):
    """A subclass may run its children any way it likes: no chain is assumed."""


def shared_relu() -> nn.Sequential:
    relu = nn.ReLU()
    return nn.Sequential(nn.Linear(8, 16), relu, nn.Linear(16, 16), relu, nn.Linear(16, 4))


def shared_first() -> nn.Sequential:
    linear = nn.Linear(8, 8)
    return nn.Sequential(linear, nn.ReLU(), linear)


CASES: list[tuple[str, Callable[[], nn.Module], list[str], bool]] = [
    ("mlp", mlp, ["1", "3"], True),
    ("gelu", lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)), ["1"], True),
    (
        "relu-dropout-linear",  # the relu's probe is handed on through the dropout's hook
        lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 4)),
        [],
        True,
    ),
    (
        "relu-before-a-non-benign-backward",
        lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), SafeLog(), nn.Linear(8, 4)),
        [],
        True,
    ),
    (
        "tanh-before-a-non-benign-backward",  # tanh does not mask: nothing to probe between
        lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), SafeLog(), nn.Linear(8, 4)),
        ["1"],
        True,
    ),
    ("shared-module", shared_relu, [], True),
    (
        "ends-in-a-relu",
        lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU()),
        ["1"],
        False,
    ),
    ("subclass", lambda: MySequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), [], False),
]


@pytest.mark.parametrize(("build", "unhooked"), [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_which_children_go_unhooked(build, unhooked):
    model = build()
    infos = module_table(model, False, ())
    chains = Chains(model, infos)
    assert sorted(infos[m].name for m in chains.unhooked) == unhooked


def test_an_mlp_hooks_its_linears_only():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        assert [bool(m._forward_hooks) for m in model] == [True, False, True, False, True]
        # The root's own hooks mark micro-steps, probe the data and the loss gradient.
        assert model._forward_pre_hooks and model._forward_hooks
        train(model, opt, 3)
    assert w.first is None
    window = w.flight_window()
    acts = dict(zip(window.modules, window.act_max_abs[-1], strict=True))
    assert all(acts[name] is not None for name in ("0", "2", "4"))  # the Linears' figures


@pytest.mark.parametrize("inplace", [False, True])
def test_a_linear_after_an_unhooked_relu_is_still_blamed_for_its_output(inplace):
    model = mlp(inplace=inplace)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model[0].weight.fill_(1.0)  # every hidden unit of the first layer is 8 on ones(4, 8)
    with nand.watch(model, opt) as w:
        for step in range(3):
            if step == 1:
                with torch.no_grad():  # finite, but 1e38 * 16 * 8 overflows float32
                    model[2].weight.fill_(1e38)
            model(torch.ones(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert where(w.first) == (1, 0, "forward", "2", "produced")


@pytest.mark.parametrize("kind", list(VALUES))
def test_an_mlp_s_bad_input_is_found_in_its_micro_step(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def inputs(step: int) -> tuple[tuple, dict]:
        x = torch.randn(4, 8)
        if step == 2 and calls["n"] % 2 == 1:  # the second micro-step of step 2
            x[0, 0] = VALUES[kind]
        calls["n"] += 1
        return (x,), {}

    calls = {"n": 0}
    with nand.watch(model, opt) as w:
        train(model, opt, 4, accum=2, inputs=inputs)
    assert where(w.first) == (2, 1, "input", "", "data")


def test_without_an_optimizer_each_call_of_a_chain_is_still_a_step():
    model = mlp()
    with nand.watch(model) as w:
        for _ in range(5):
            model(torch.randn(4, 8)).sum().backward()
    assert w.step == 5 and w.host_reads == 5


@pytest.mark.parametrize("kind", list(VALUES))
def test_an_mlp_s_bad_input_is_reported_as_the_data_with_its_values(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        for step in range(3):
            x = torch.randn(4, 8)
            if step == 1:
                x[2, 3] = VALUES[kind]
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert where(w.first) == (1, 0, "input", "", "data")
    assert w.first.shape == [4, 8] and w.first.dtype == "float32"
    assert w.first.message.split(" in input")[0].endswith({"nan": "NaN"}.get(kind, kind))


def test_the_first_linear_is_blamed_for_its_own_overflow_on_finite_input():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def inputs(step: int) -> tuple[tuple, dict]:
        if step < 2:
            return (torch.ones(4, 8),), {}
        with torch.no_grad():
            model[0].weight.fill_(1.0)
        return (torch.full((4, 8), 1e38),), {}  # finite; summed over 8 inputs it overflows

    with nand.watch(model, opt) as w:
        train(model, opt, 3, inputs=inputs)
    assert where(w.first) == (2, 0, "forward", "0", "produced")


def test_an_allow_listed_first_linear_still_probes_the_input():
    # Only its max is watched, so a -inf input could leave it finite-looking.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt, allow_nonfinite=["0"]) as w:
        model(torch.randn(4, 8)).sum().backward()
        assert any(s is not None and s.phase == "input" for s in w._buf.sites)
        x = torch.randn(4, 8)
        x[0, 0] = float("-inf")
        opt.step()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    assert where(w.first) == (1, 0, "input", "", "data")
