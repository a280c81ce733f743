"""A compiled model in the light mode: the root's hooks outside the graph,
the model's graph without probes, its incident replayed under force_eager
(``detect/eager.py``); without ``set_stance``, the full mode as before."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.eval_frame import OptimizedModule

import nand
from nand.agent.detect import eager, tiers
from tests.agent.models import mlp, train
from tests.integrations.test_compile import recorded


class Exp(nn.Module):
    """A custom activation: ``exp`` overflows once ``scale`` (a 0-d buffer) is large."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(x * self.scale)


#: Where the eager code makes the infinity: the line of ``Exp.forward``'s body.
EXP_LINE = f"{__file__}:{Exp.forward.__code__.co_firstlineno + 1}"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 16)
        self.act = Exp()
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.act(self.fc(x)))


def exp_fault(how: str, mode: str = "light") -> tuple[nand.Event, Any, list[str]]:
    """``act`` overflows at step 2 of 4; ``how``: ``wrap`` (``torch.compile(model)``)
    or ``in-place`` (``model.compile()``). Returns the first event, the watch's
    tiers and nand's warnings."""
    torch._dynamo.reset()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with recorded("nand") as log, nand.watch(model, opt, mode=mode, log_events=False) as w:
        if how == "wrap":
            run: nn.Module = torch.compile(model, backend="aot_eager")
        else:
            model.compile(backend="aot_eager")
            run = model

        def before(step: int, micro: int) -> None:
            model.act.scale.fill_(1e3 if step == 2 else 1.0)

        train(run, opt, 4, before=before)
    assert w.first is not None
    warnings = [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]
    return w.first, w._tiers, warnings


@pytest.mark.parametrize("how", ["wrap", "in-place"])
def test_an_overflow_in_a_compiled_custom_activation_is_replayed_with_its_op_and_line(how):
    # Before: (2, forward, act) from the full mode's probes, op and line
    # empty, reproduced None: "the inputs of micro-step 0 were not held".
    first, tiers_of_watch, warnings = exp_fault(how)
    assert (first.step, first.phase, first.module, first.cause) == (2, "forward", "act", "produced")
    assert (first.op, first.source, first.reproduced) == ("aten::exp", EXP_LINE, True)
    assert tiers_of_watch.light and tiers_of_watch.compiled and warnings == []


def test_the_graph_compiled_for_a_light_watched_model_holds_the_model_s_ops_only():
    # The root's hooks run outside the graph (eager.py): one graph, the
    # model's three ops, no probe. Before: every module's probe (aminmax)
    # was compiled into the graph, the light mode turned full at trace time.
    graphs: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:
        train(torch.compile(model, backend=backend), opt, 3, accum=2)
    assert len(graphs) == 1 and len(graphs[0]) == 5, graphs  # linear, relu, linear, relu, linear
    assert not any("aminmax" in op for op in graphs[0])
    assert w._tiers.light and w.first is None and w.step == 3


def test_without_set_stance_a_compiled_light_watch_goes_full_while_traced_said_once(
    monkeypatch,
):
    # torch < 2.6 has no torch.compiler.set_stance: no eager replay of
    # compiled code, so the light mode turns full at trace time, as before.
    monkeypatch.setattr(tiers, "HAS_STANCE", False)
    monkeypatch.setattr(eager, "HAS_STANCE", False)
    first, tiers_of_watch, warnings = exp_fault("wrap")
    assert (first.step, first.phase, first.module, first.cause) == (2, "forward", "act", "produced")
    assert not tiers_of_watch.light
    assert len(warnings) == 1 and "set_stance" in warnings[0] and "mode='full'" in warnings[0]


class Block(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.fc(x))


class Blocks(nn.Module):
    """Two residual blocks, the second's activation an :class:`Exp`: a model
    whose blocks can be compiled one by one, as large models are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(nn.Tanh()), Block(Exp())])
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def exp(self) -> Exp:
        block = self.blocks[1]
        return cast(Exp, getattr(block, "_orig_mod", block).act)


def first_per_step(steps: int, scales: dict[int, float]) -> dict[int, tuple[str, list[int]]]:
    """Without nand: the eager model, plain forward hooks on every module;
    by step, the first module whose output went non-finite, and its shape.
    A step with a non-finite gradient is not applied (nand's ``skip``)."""
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    now = [0]
    first: dict[int, tuple[str, list[int]]] = {}
    for name, module in model.named_modules():

        def seen(m: nn.Module, args: Any, out: Tensor, name: str = name) -> None:
            if not bool(out.isfinite().all()):
                first.setdefault(now[0], (name, list(out.shape)))

        module.register_forward_hook(seen)

    def before(step: int, micro: int) -> None:
        now[0] = step
        model.exp().scale.fill_(scales.get(step, 1.0))

    def skip(step: int) -> None:
        if not all(bool(p.grad.isfinite().all()) for p in model.parameters()):
            opt.zero_grad()

    train(model, opt, steps, before=before, after_backward=skip)
    return first


def compile_as(model: Blocks, how: str, backend: Any) -> nn.Module:
    """The model as the loop calls it: compiled whole, or each block alone."""
    if how == "model":
        return cast(nn.Module, torch.compile(model, backend=backend))
    for i, block in enumerate(model.blocks):
        if how == "blocks in place":
            block.compile(backend=backend)
        else:
            model.blocks[i] = torch.compile(block, backend=backend)
    return model


@pytest.mark.nand_mode("light")
@pytest.mark.parametrize("how", ["model", "blocks in place", "blocks wrapped"])
def test_a_compiled_model_probed_after_an_inexact_incident_names_the_next_one_s_module(
    monkeypatch, how
):
    # Step 1's overflow is transient (the scale is put back before the
    # boundary, so the replay runs finite): not exact, every module probed
    # for NAND_FULL_STEPS=2 steps, in which the model runs eagerly; step 3's
    # overflow falls in them, and the full mode names its module with its
    # shape. Then the compiled code runs again, and step 6's overflow is
    # replayed in the light mode. Before: blocks compiled alone ignored the
    # probes added inside them (step 3 named ``blocks.1``); a model compiled
    # whole was traced again with the probes in its graph (no shape, no
    # gradient probes, one recompile).
    monkeypatch.setenv("NAND_FULL_STEPS", "2")
    scales = {1: 1e3, 3: 1e3, 6: 1e3}
    truth = first_per_step(8, scales)
    assert [truth[s][0] for s in (1, 3, 6)] == ["blocks.1.act"] * 3
    calls: list[int] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        compiled = aot_eager(gm, example)

        def counted(*args: Any) -> Any:
            calls.append(len(calls))
            return compiled(*args)

        return counted

    torch._dynamo.reset()
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    graphs_before: dict[int, int] = {}
    with (
        recorded("nand") as log,
        nand.watch(model, opt, on_nonfinite="skip", log_events=False) as w,
    ):
        run = compile_as(model, how, backend)

        def before(step: int, micro: int) -> None:
            model.exp().scale.fill_(scales.get(step, 1.0))
            graphs_before[step] = len(calls)

        def transient(step: int) -> None:
            if step == 1:  # (gone by the boundary: the replay runs finite)
                model.exp().scale.fill_(1.0)

        train(run, opt, 8, before=before, after_backward=transient)
        graphs_before[8] = len(calls)
    first, second, third = w.events
    assert (second.step, second.phase, second.cause) == (3, "forward", "produced")
    assert second.module == truth[3][0]
    assert (second.shape, second.op, second.source) == (truth[3][1], "aten::exp", EXP_LINE)
    assert (first.step, first.module, first.reproduced) == (1, "", False)
    assert first.replay.endswith(
        "probed for the next 2 steps (mode='full'), "
        "the compiled model running eagerly meanwhile, then light again"
    )
    assert (third.step, third.module, third.op, third.reproduced) == (
        6,
        truth[6][0],
        "aten::exp",
        True,
    )
    assert third.replay == "replayed the forward of micro-step 0"
    # The compiled graphs ran in the light steps, not in the full ones.
    graphs = [graphs_before[s + 1] - graphs_before[s] for s in range(8)]
    assert [s for s, n in enumerate(graphs) if n == 0] == [2, 3], graphs
    said = [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]
    warnings = [m for m in said if "skipped optimizer step" not in m]  # (the policy's)
    assert [m.split("; ")[-1] for m in warnings] == [
        "every module is probed for the next 2 steps (mode='full'), "
        "the compiled model running eagerly meanwhile, then light again",
        "back to the light mode",
    ]
    # Nothing of nand's is left on the model.
    for module in model.modules():
        assert "forward" not in vars(module) or isinstance(module, OptimizedModule)
