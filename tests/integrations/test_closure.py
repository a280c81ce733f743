"""``optimizer.step(closure)``: the forward and backward run inside the step.

Lightning's automatic optimization and LBFGS train this way: the closure runs
after the optimizer's step pre-hooks fired. nand must give the same step,
phase and module as without a closure, and ``raise`` must stop the update.
"""

from __future__ import annotations

import pytest

import nand
from tests.integrations.check import planted_answer
from tests.integrations.faults import KINDS, Fault
from tests.integrations.loops import CLOSURE, FP32, Loop, expected, where, with_nand
from tests.integrations.zoo import case

pytest.importorskip("transformers")

MODELS = ["gpt2", "bert", "resnet18"]  # the closure changes the optimizer's path, not the model's


def closure_cells(kinds: tuple[str, ...] | list[str]) -> list:
    return [pytest.param(m, k, id=f"{m}-{k}") for m in MODELS for k in kinds]


@pytest.mark.parametrize("model,kind", closure_cells(KINDS))
def test_a_fault_with_a_closure_is_reported_as_it_is_without_one(model, kind):
    fault = Fault(kind, 2, case(model).sites[kind])
    without = planted_answer(expected(model, FP32, fault, 4), fault)
    # The truth agrees with itself across the two loops: the closure moves nothing.
    assert expected(model, CLOSURE, fault, 4).truth.first == without  # type: ignore[union-attr]
    run = with_nand(model, CLOSURE, fault, 4)
    assert run.watch is not None and where(run.watch.first) == without


RAISE_KINDS = ("forward", "backward", "input", "loss")  # an lr blow-up is made by the update itself


@pytest.mark.parametrize("closure", [False, True])
@pytest.mark.parametrize("model,kind", [(m, k) for m in MODELS for k in RAISE_KINDS])
def test_raise_stops_before_the_update_and_leaves_the_weights_finite(model, kind, closure):
    fault = Fault(kind, 2, case(model).sites[kind])
    answer = planted_answer(expected(model, FP32, fault, 4), fault)
    loop = Loop(model, CLOSURE if closure else FP32, fault, "nand", on_nonfinite="raise")
    try:
        with pytest.raises(nand.NonFiniteError) as raised:
            loop.train(4)
    finally:
        loop.close()
    assert where(raised.value.event) == answer
    assert loop.step == fault.step  # raised out of that step's optimizer.step()
    assert loop.params_finite
