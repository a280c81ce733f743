"""A compiled real model in the default (light) mode stays light, and its
incident is replayed eagerly, with the op and the line, as in eager code.

HF GPT-2 and an HF ResNet-18 (basic blocks, 2-2-2-2; built from configs,
random init) are compiled after ``nand.watch`` with ``aot_eager`` and with
``inductor`` (slow: it compiles C++ kernels). One
activation is replaced by a hand-written softplus whose ``exp`` overflows
once its sharpness is raised at the last step. The answer comes from an
eager twin run without nand: plain hooks on every module and a dispatch
mode that records the first aten op making a non-finite value from finite
inputs, with its line in this file.

Before (the light mode turned full while dynamo traced the first compiled
call): a warning was logged, every module's probes ran in the compiled
graph, and the event had no op, no line and ``reproduced`` None ("the
inputs of micro-step 0 were not held (the model ran compiled ...)").
"""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nand
from tests.integrations.test_compile import recorded
from tests.integrations.zoo import case

pytest.importorskip("transformers")

STEPS = 3  # the last one overflows
SHARP = 1e4  # exp(x * SHARP) overflows float32 for x > 0.0089
#: Where each model gets the hand-written activation.
SITES = {
    "gpt2": "transformer.h.1.mlp.act",
    "resnet18": "resnet.encoder.stages.1.layers.0.layer.0.activation",
}


class SoftExp(nn.Module):
    """softplus(s·x)/s written by hand; ``sharpness`` a 0-d buffer (no guard)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("sharpness", torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        return torch.log1p(torch.exp(x * self.sharpness)) / self.sharpness


class Answer(NamedTuple):
    step: int
    module: str
    op: str
    source: str


def _floats(value: Any) -> list[Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, Tensor) and t.is_floating_point()]


class FirstOp(TorchDispatchMode):
    """The first aten op whose output is non-finite while its inputs are
    finite: the step, the innermost module running, the op, its line here."""

    def __init__(self, running: list[str]) -> None:
        super().__init__()
        self.running = running
        self.step = 0
        self.found: Answer | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if "empty" in func._schema.name:  # (uninitialised memory: no value made)
            return out
        if self.found is None and _made(out, (args, kwargs)):
            name, overload = func._schema.name, func._overloadname
            op = name if overload == "default" else f"{name}.{overload}"
            stack = traceback.extract_stack()
            here = [f for f in stack if f.filename == __file__ and f.name == "forward"][-1]
            line = f"{here.filename}:{here.lineno}"
            self.found = Answer(self.step, self.running[-1], op, line)
        return out


def _made(out: Any, inputs: Any) -> bool:
    """A non-finite output from finite inputs, and no infinity written on
    purpose from a Python number (an attention mask's)."""
    if all(bool(t.isfinite().all()) for t in _floats(out)):
        return False
    if any(isinstance(x, float) and not math.isfinite(x) for x in tree_leaves(inputs)):
        return False
    return all(bool(t.isfinite().all()) for t in _floats(inputs))


class Built(NamedTuple):
    model: nn.Module
    act: SoftExp
    opt: torch.optim.Optimizer


def build(name: str) -> Built:
    model = case(name).build()
    parent, _, attr = SITES[name].rpartition(".")
    act = SoftExp()
    setattr(model.get_submodule(parent), attr, act)
    return Built(model, act, torch.optim.AdamW(model.parameters(), lr=1e-3))


def train(name: str, built: Built, run: Any, first: FirstOp | None = None) -> None:
    """STEPS steps, the last one's activation sharp; ``run``: the model as called."""
    torch.manual_seed(1)
    for step in range(STEPS):
        built.act.sharpness.fill_(SHARP if step == STEPS - 1 else 1.0)
        batch = case(name).batch(step)
        if first is not None:
            first.step = step
        with first if first is not None else contextlib.nullcontext():
            loss = case(name).loss(run, batch)
        loss.backward()
        built.opt.step()
        built.opt.zero_grad()


def eager_truth(name: str) -> Answer:
    """Where the eager model, without nand, first made a non-finite value."""
    built = build(name)
    running: list[str] = []

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        running.pop()

    for qual, module in built.model.named_modules():
        module.register_forward_pre_hook(lambda m, a, q=qual: running.append(q))
        module.register_forward_hook(leave)
    first = FirstOp(running)
    train(name, built, built.model, first)
    assert first.found is not None
    return first.found


class Run(NamedTuple):
    watch: nand.Watch
    warnings: list[str]


def compiled_run(name: str, backend: str) -> Run:
    """The same model, watched in the default mode, compiled after the watch."""
    torch._dynamo.reset()
    built = build(name)
    with recorded("nand") as log, nand.watch(built.model, built.opt, log_events=False) as watch:
        train(name, built, torch.compile(built.model, backend=backend))
    warnings = [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]
    return Run(watch, warnings)


#: ``inductor`` compiles 30-40 C++ kernels per model (cold cache): ~60 s of
#: CPU a run, 225 s (GPT-2) and 302 s (ResNet-18) of wall side by side on 2
#: cores under a load of ~10. Slow, with a limit of its own, 3x the longest.
INDUCTOR = pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.timeout(900)])
BACKENDS = ["aot_eager", INDUCTOR]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SITES))
def test_a_compiled_model_stays_light_and_its_overflow_is_replayed_with_the_op_and_line(
    name, backend
):
    truth = eager_truth(name)
    run = compiled_run(name, backend)
    watch = run.watch
    assert run.warnings == []  # no switch to the full mode, nothing else to say
    assert watch._tiers.light and watch._tiers.compiled
    assert [e.step for e in watch.events] == [truth.step]
    first = watch.first
    assert first is not None
    assert (first.phase, first.cause, first.micro_step) == ("forward", "produced", 0)
    assert (first.step, first.module, first.op, first.source) == truth
    assert first.reproduced is True
    assert first.replay == "replayed the forward of micro-step 0"
