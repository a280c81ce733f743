"""One (model, fault) pair with its answer, in pieces a framework's loop can take.

The framework tests (a Lightning ``LightningModule``, an HF ``Trainer``, an
accelerate loop) build everything from a :class:`Scenario`: the model, the
optimizer (AdamW with the fault's parameter group), the data as a
``Dataset``, and the :class:`~tests.integrations.faults.Planted` fault whose
hooks go on before nand's. The answer nand must give is the ground truth's
in the plain loop (``scenario.answer``): which step, phase and module do
not depend on who runs the loop, as long as it does the same iterations.

Sketch of a framework loop (``training_step`` or its like)::

    s = scenario("gpt2", "forward", step=2)
    model = s.build()
    planted = s.plant(model)                   # before nand.watch
    optimizer = s.optimizer(model)
    for step, batch in enumerate(DataLoader(s.dataset(4), batch_size=None)):
        planted.arm(step)
        loss = planted.loss(s.case.loss(model, planted.batch(batch)))
        loss.backward()
        planted.before_update(optimizer, step)
        optimizer.step(); optimizer.zero_grad()
    assert where(watch.first) == s.answer
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from tests.integrations.check import planted_answer
from tests.integrations.faults import Fault, Planted, param_groups
from tests.integrations.loops import FP32, LR, Mode, expected
from tests.integrations.truth import Finding
from tests.integrations.zoo import Case, case, float_input_needed


class Batches(torch.utils.data.Dataset):
    """A case's batches in order, whole: use ``DataLoader(..., batch_size=None)``."""

    def __init__(self, case: Case, count: int, float_input: bool) -> None:
        self.case, self.count, self.float_input = case, count, float_input

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.case.batch(index, self.float_input)


@dataclasses.dataclass(frozen=True)
class Scenario:
    case: Case
    fault: Fault | None  # None: a healthy run
    answer: Finding | None  # the ground truth's first finding in the plain loop

    def build(self) -> nn.Module:
        return self.case.build()

    def plant(self, model: nn.Module) -> Planted:
        return Planted(self.fault, model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        isolate = self.fault.where if self.fault and self.fault.kind == "lr" else None
        return torch.optim.AdamW(param_groups(model, isolate), lr=LR)

    def dataset(self, count: int) -> Batches:
        kind = self.fault.kind if self.fault else ""
        return Batches(self.case, count, float_input_needed(self.case, kind))


def scenario(
    model: str, kind: str, step: int = 2, value: str = "nan", mode: Mode = FP32, steps: int = 4
) -> Scenario:
    """Build the pair and establish its answer with the truth in the plain loop."""
    the_case = case(model)
    fault = Fault(kind, step, the_case.sites[kind], value)
    return Scenario(the_case, fault, planted_answer(expected(model, mode, fault, steps), fault))


def healthy(model: str, mode: Mode = FP32, steps: int = 4) -> Scenario:
    """A run with nothing planted, after checking the truth sees nothing in the plain loop."""
    truth_run = expected(model, mode, None, steps)
    assert truth_run.truth is not None and truth_run.truth.first is None, truth_run.truth.first
    return Scenario(case(model), None, None)
