"""A Scenario's pieces, driven by a loop of another shape, give the plain loop's answer.

The framework tests rely on this: the answer does not depend on who drives
the iterations. The loop here takes its data from a DataLoader and attaches
the truth from outside, as a framework callback would.
"""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from tests.integrations.faults import KINDS
from tests.integrations.scenario import scenario
from tests.integrations.truth import Truth

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", KINDS)
def test_a_dataloader_loop_built_from_a_scenario_finds_the_plain_loops_answer(kind):
    s = scenario("vit", kind)
    model = s.build()
    planted = s.plant(model)
    optimizer = s.optimizer(model)
    with Truth(model, optimizer) as truth:
        for step, batch in enumerate(DataLoader(s.dataset(4), batch_size=None)):
            planted.arm(step)
            planted.loss(s.case.loss(model, planted.batch(batch))).backward()
            planted.before_update(optimizer, step)
            optimizer.step()
            optimizer.zero_grad()
            truth.end_step()
    assert truth.first == s.answer
