"""``torch.compile`` of whole real models after ``nand.watch``.

Under ``backend="aot_eager"`` (torch 2.13 CPU, transformers 5.24) nand stays
on, finds every planted forward fault at the step, phase and module of the
eager run, and brackets a backward fault between two modules by the
parameters' gradients (no gradient inside a compiled graph is probed). Its
hooks cost at most one recompile: probes fill trace-time slots, so dynamo
never guards on nand's buffer lengths or step counters.

Recompiles are counted from dynamo's ``recompiles`` log (one record per
recompilation, with the failed guard): ``counters["frames"]`` also counts the
first compilation of every frame a graph break makes, which is not a
recompile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo

from tests.integrations.check import planted_answer
from tests.integrations.faults import Fault
from tests.integrations.loops import FP32, Loop, Mode, expected, where
from tests.integrations.zoo import case

pytest.importorskip("transformers")

MODELS = ["gpt2", "llama", "vit", "resnet18"]
AOT_EAGER = Mode("aot_eager", compile="aot_eager")
INDUCTOR = Mode("inductor", compile="inductor")
STEPS = 4


class Records(logging.Handler):
    """Keeps the records of one logger while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@contextlib.contextmanager
def recorded(logger_name: str) -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@dataclasses.dataclass
class Compiled:
    """One compiled run: the loop, its recompiles and what nand logged."""

    loop: Loop
    recompiles: list[str]
    nand_log: list[str]


def compiled_run(
    model: str,
    mode: Mode,
    observer: str,
    fault: Fault | None = None,
    steps: int = STEPS,
) -> Compiled:
    torch._dynamo.reset()  # a fresh cache: the twin runs compile from scratch alike
    torch._logging.set_logs(recompiles=True)
    try:
        with (
            recorded("torch._dynamo.guards.__recompiles") as recompiles,
            recorded("nand") as nand_log,
        ):
            loop = Loop(model, mode, fault, observer=observer)
            try:
                loop.train(steps)
            finally:
                loop.close()
    finally:
        torch._logging.set_logs()
    return Compiled(loop, recompiles.messages(), nand_log.messages())


def last_step_fault(model: str, kind: str = "forward") -> Fault:
    """A fault at the last step: the steps before it are a healthy compiled run."""
    return Fault(kind, STEPS - 1, case(model).sites[kind])


@pytest.fixture(scope="module", params=MODELS)
def twins(request: pytest.FixtureRequest) -> tuple[Compiled, Compiled]:
    """(without nand, with nand): one compiled run each, healthy until a forward fault
    at the last step. One compilation serves three tests: compiling is most of the cost."""
    fault = last_step_fault(request.param)
    without = compiled_run(request.param, AOT_EAGER, "", fault)
    return without, compiled_run(request.param, AOT_EAGER, "nand", fault)


def test_a_compiled_run_reports_nothing_until_the_fault_and_nand_never_switches_off(twins):
    without, run = twins
    watch = run.loop.watch
    assert watch is not None and watch.step == STEPS
    assert [e.step for e in watch.events] == [STEPS - 1]  # the planted fault's, nothing before
    assert not watch._guard.off
    assert not [m for m in run.nand_log if "internal error" in m]
    # Not bit for bit as in eager: nand's graph breaks move where aot_eager's
    # graphs begin and end, and LLaMA's losses then differ in the last bits.
    torch.testing.assert_close(
        run.loop.losses, without.loop.losses, rtol=1e-6, atol=0, equal_nan=True
    )


def test_nand_adds_at_most_one_recompile_to_a_compiled_run(twins):
    without, run = twins
    assert len(run.recompiles) <= len(without.recompiles) + 1, run.recompiles[:3]


def test_a_forward_fault_in_a_compiled_model_is_found_where_the_eager_truth_saw_it(twins):
    # The answer comes from the eager twin: compiling must not move it. Every
    # module was observable under aot_eager here, so the module is asserted too.
    _, run = twins
    fault = last_step_fault(run.loop.case.name)
    answer = planted_answer(expected(run.loop.case.name, FP32, fault, STEPS), fault)
    assert run.loop.watch is not None and where(run.loop.watch.first) == answer


BRACKET = re.compile(r"made between (\S+), the last module in forward order")


@pytest.mark.nand_mode("full")
@pytest.mark.parametrize("model", MODELS)
def test_a_backward_fault_in_a_compiled_model_is_bracketed_around_the_eager_truth_in_full(model):
    # Inside a compiled graph no gradient is probed, only the parameters'
    # gradients: the full mode names the step and phase exactly and brackets
    # the module (the last module whose parameters got a non-finite gradient,
    # and the first after it whose stayed finite). The eager truth's module
    # must lie in that bracket, in the model's module order.
    fault = last_step_fault(model, "backward")
    answer = planted_answer(expected(model, FP32, fault, STEPS), fault)
    run = compiled_run(model, AOT_EAGER, "nand", fault)
    first = run.loop.watch.first if run.loop.watch is not None else None
    assert first is not None and (first.step, first.phase) == (answer.step, answer.phase)
    bracket = BRACKET.search(first.message)
    assert bracket is not None, first.message
    order = [name for name, _ in run.loop.model.named_modules()]
    last_bad = bracket.group(1)
    lower, upper = order.index(last_bad), order.index(first.module)
    inside = last_bad.startswith(answer.module + ".")  # a block whose last layer is last_bad
    assert inside or lower <= order.index(answer.module) < upper, (answer.module, first.message)


@pytest.mark.nand_mode("light")  # the full mode's answer is the bracket above
@pytest.mark.parametrize("model", MODELS)
def test_a_backward_fault_in_a_compiled_model_is_found_where_the_eager_truth_saw_it(model):
    # The default (light) mode replays the step eagerly (force_eager) with
    # every module probed: the module itself, not a bracket. Before: the
    # light mode turned full at trace time and gave the full mode's bracket.
    fault = last_step_fault(model, "backward")
    answer = planted_answer(expected(model, FP32, fault, STEPS), fault)
    run = compiled_run(model, AOT_EAGER, "nand", fault)
    assert run.loop.watch is not None and where(run.loop.watch.first) == answer


@pytest.mark.slow
def test_inductor_on_a_vit_keeps_nand_on_and_finds_a_forward_fault():
    # Inductor compiles C++ for every graph (10-40 s a run on this CPU): one
    # model, and "slow". Kernels fuse differently once nand's graph breaks
    # split the model: losses are compared to float32 precision.
    fault = last_step_fault("vit")
    without = compiled_run("vit", INDUCTOR, "", fault)
    run = compiled_run("vit", INDUCTOR, "nand", fault)
    watch = run.loop.watch
    assert watch is not None and not watch._guard.off
    assert not [m for m in run.nand_log if "internal error" in m]
    assert where(watch.first) == planted_answer(expected("vit", FP32, fault, STEPS), fault)
    assert [e.step for e in watch.events] == [STEPS - 1]
    torch.testing.assert_close(
        run.loop.losses, without.loop.losses, rtol=1e-5, atol=0, equal_nan=True
    )
