"""A parameter made non-finite by code other than the optimizer (a checkpoint,
user code) between two steps: SGD's parameters are implied finite by a carried
bound and not read, so the next forward's finding leads to it
(``analysis.param_behind``). The ground truth: the test writes one element."""

from __future__ import annotations

import pytest
import torch

import nand
from tests.agent.models import VALUES, mlp, train, where
from tests.agent.test_detection import corrupt_after_step


@pytest.mark.parametrize("kind", list(VALUES))
def test_a_parameter_written_between_steps_is_reported_with_its_one_bad_element(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    corrupt_after_step(opt, 1, lambda: model[2].weight.data.__setitem__((3, 5), VALUES[kind]))
    with nand.watch(model, opt) as w:
        train(model, opt, 4)
    assert where(w.first) == (1, 0, "param", "2.weight", "produced")
    counts = {"nan": w.first.nan, "+inf": w.first.posinf, "-inf": w.first.neginf}
    assert counts[kind] == 1 and sum(counts.values()) == 1
    assert w.first.shape == [16, 16]
