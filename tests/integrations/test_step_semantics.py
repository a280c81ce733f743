"""``step`` is the training iteration: every ``optimizer.step()`` or ``scaler.step(opt)``.

A GradScaler skips the update of an iteration whose scaled gradients
overflowed; the loop, HF ``Trainer`` (``state.global_step``) and Lightning
(``trainer.global_step``) still count that iteration, and so must nand.
The skipped iterations come from the ground truth's run, not from a guess.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.integrations.check import assert_reported_as_the_truth_says
from tests.integrations.faults import Fault
from tests.integrations.loops import FP16_SCALER_NOT_PASSED, FP16_SCALER_PASSED, expected, with_nand
from tests.integrations.zoo import case

pytest.importorskip("transformers")

#: ViT at this initial scale overflows in exactly its first four iterations.
MODEL, SCALE = "vit", 2.0**20

MODES = [
    pytest.param(dataclasses.replace(FP16_SCALER_PASSED, init_scale=SCALE)),
    pytest.param(dataclasses.replace(FP16_SCALER_NOT_PASSED, init_scale=SCALE)),
]


def skipped_iterations(mode, steps: int) -> list[int]:
    truth = expected(MODEL, mode, None, steps).truth
    assert truth is not None
    return truth.skipped


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_watch_step_counts_every_iteration_whether_the_update_was_applied_or_skipped(mode):
    assert skipped_iterations(mode, 6) == [0, 1, 2, 3]
    run = with_nand(MODEL, mode, None, 6)
    assert run.watch is not None and run.watch.step == 6 == run.step


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_fault_at_iteration_4_after_four_skipped_iterations_is_reported_at_step_4(mode):
    assert skipped_iterations(mode, 6) == [0, 1, 2, 3]
    fault = Fault("forward", 4, case(MODEL).sites["forward"])
    assert_reported_as_the_truth_says(MODEL, mode, fault, steps=6)  # the truth: step 4, micro 0
