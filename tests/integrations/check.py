"""What a test asserts of twin runs: one with the ground truth, one with nand."""

from __future__ import annotations

import math
from typing import Any

from tests.integrations.faults import PHASE, Fault
from tests.integrations.loops import Loop, Mode, expected, where, with_nand
from tests.integrations.truth import Finding


def same_losses(a: list[float], b: list[float]) -> bool:
    """Equal bit for bit, NaN equal to NaN: nand must not change what is computed."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


def planted_answer(truth_run: Loop, fault: Fault) -> Finding:
    """The truth's answer for a fault, after checking it saw the fault where it was planted.

    The check is of the planting, not of nand: a fault that went elsewhere
    (a site the data never reaches) would make the comparison meaningless.
    """
    assert truth_run.truth is not None
    first = truth_run.truth.first
    assert first is not None, f"the truth saw nothing of {fault}"
    assert (first.step, first.phase) == (fault.step, PHASE[fault.kind]), first
    if fault.kind in ("forward", "backward", "lr"):
        assert first.module == fault.where, first
    return first


def assert_reported_as_the_truth_says(
    case_name: str, mode: Mode, fault: Fault, steps: int = 4, prepare: Any = None, **options: Any
) -> Loop:
    """nand's first event is the truth's answer; the losses are those of the truth's run."""
    truth_run = expected(case_name, mode, fault, steps, prepare)
    answer = planted_answer(truth_run, fault)
    run = with_nand(case_name, mode, fault, steps, prepare, **options)
    assert run.watch is not None
    assert where(run.watch.first) == answer
    assert same_losses(run.losses, truth_run.losses)
    return run


def assert_healthy(case_name: str, mode: Mode, steps: int, **options: Any) -> tuple[Loop, Loop]:
    """No finding, no event, the same losses; returns (truth run, nand run)."""
    truth_run = expected(case_name, mode, None, steps)
    assert truth_run.truth is not None and truth_run.truth.first is None
    run = with_nand(case_name, mode, None, steps, **options)
    assert run.watch is not None
    assert [where(e) for e in run.watch.events] == []
    assert same_losses(run.losses, truth_run.losses)
    return truth_run, run
