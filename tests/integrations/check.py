"""What a test asserts of twin runs: one with the ground truth, one with nand."""

from __future__ import annotations

import math
from typing import Any

from nand.agent.detect.tiers import CHECKED
from tests.integrations.faults import PHASE, Fault
from tests.integrations.loops import Loop, Mode, expected, where, with_nand
from tests.integrations.truth import Finding, Truth


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


def replayed_armed(mode: Mode, fault: Fault) -> bool:
    """Whether a replay at the step's boundary runs with ``fault`` armed.

    A planted fault is armed by the loop for one micro-step, from outside
    the model (a transient fault, as far as the model can tell); the loop
    disarms it at the next. The light mode replays at the boundary, after
    the step's last micro-step: a forward or backward fault of an earlier
    one is not there to be seen again, and no replay could be exact.
    """
    return fault.kind not in ("forward", "backward") or fault.micro == mode.accum - 1


def assert_said_not_exact(watch: Any, answer: Finding, truth: Truth, mode: Mode) -> None:
    """The light mode's first event where no replay can see the fault again,
    held to the truth in what it says: a forward fault is the root's output
    (the only module checked) at the truth's micro-step; a backward fault is
    a parameter's gradient, read at the step's last micro-step, that the
    truth saw non-finite before the update. The event says what was checked,
    and every module is probed from then on.

    (Not its cause: it says ``produced`` of a gradient the truth saw made by
    a module's backward, which light mode did not check.)
    """
    first = watch.first
    assert first is not None and first.step == answer.step, first
    if answer.phase == "forward":
        said = (first.micro_step, first.phase, first.module)
        assert said == (answer.micro_step, "forward", ""), first  # "": the root
    else:
        assert (first.micro_step, first.phase) == (mode.accum - 1, "grad"), first
        assert first.module in truth.bad_grads.get(answer.step, set()), (first, truth.bad_grads)
    assert not first.reproduced and CHECKED in first.replay, first.replay
    assert not watch._tiers.light


def assert_reported_as_the_truth_says(
    case_name: str, mode: Mode, fault: Fault, steps: int = 4, prepare: Any = None, **options: Any
) -> Loop:
    """nand's first event is the truth's answer; the losses are those of the truth's run."""
    truth_run = expected(case_name, mode, fault, steps, prepare)
    answer = planted_answer(truth_run, fault)
    run = with_nand(case_name, mode, fault, steps, prepare, **options)
    assert run.watch is not None
    if run.watch.settings.mode == "light" and not replayed_armed(mode, fault):
        assert truth_run.truth is not None
        assert_said_not_exact(run.watch, answer, truth_run.truth, mode)
    else:
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
