"""A compiled model in the light mode: the root's hooks outside the graph,
the model's graph without probes, its incident replayed under force_eager
(``detect/eager.py``); without ``set_stance``, the full mode as before."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import Tensor, nn

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
