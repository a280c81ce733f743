"""Per-sample gradients through ``torch.func`` (``vmap`` of ``grad``), as
differential-privacy training computes them, on real models.

nand's hooks cannot probe the batched values inside the transform: they leave
them alone and nand stays on (before, the first forward switched it off).
What the loop then does with the per-sample gradients, their mean written
into ``.grad`` and the optimizer's update, is checked as in any loop. The
answer for an overflowing update comes from the parameters themselves, read
without nand after each step.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import nand
from tests.integrations.faults import Fault, Planted, param_groups
from tests.integrations.loops import where
from tests.integrations.truth import Finding
from tests.integrations.zoo import case

pytest.importorskip("transformers")

#: Models whose forward vmap can batch (GPT-2's and BERT's dropout would need
#: ``randomness=``; the HF ResNet's BatchNorm updates its statistics in place).
MODELS = ["llama", "vit"]
STEPS, FAULT_STEP = 4, 2


class PerSampleLoop:
    """AdamW on the mean of per-sample gradients; ``lr_fault``: the learning
    rate of one parameter's group becomes inf at FAULT_STEP."""

    def __init__(self, name: str, watched: bool, lr_fault: bool) -> None:
        self.case = case(name)
        self.model = self.case.build()
        fault = Fault("lr", FAULT_STEP, self.case.sites["lr"]) if lr_fault else None
        self.planted = Planted(fault, self.model)  # an lr fault: no hook in the model
        isolate = fault.where if fault is not None else None
        self.optimizer = torch.optim.AdamW(param_groups(self.model, isolate), lr=1e-3)
        self.watch = nand.watch(self.model, self.optimizer) if watched else None
        self.losses: list[float] = []
        self.first_bad_param: Finding | None = None  # the ground truth, read without nand

    def train(self) -> PerSampleLoop:
        torch.manual_seed(1)
        try:
            for step in range(STEPS):
                self._step(step)
        finally:
            if self.watch is not None:
                self.watch.close()
        return self

    def _step(self, step: int) -> None:
        params = {k: p.detach() for k, p in self.model.named_parameters()}
        batch = self.case.batch(step)
        grads, losses = vmap(grad(self._sample_loss, has_aux=True), in_dims=(None, 0))(
            params, batch
        )
        self.losses.append(float(losses.mean()))
        for name, p in self.model.named_parameters():
            p.grad = grads[name].mean(0)
        self.planted.before_update(self.optimizer, step)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.first_bad_param is None:
            self.first_bad_param = _first_non_finite_param(self.model, step)

    def _sample_loss(self, params: dict[str, Tensor], sample: dict[str, Tensor]) -> Any:
        one = {key: value.unsqueeze(0) for key, value in sample.items()}
        loss = self.case.loss(_Functional(self.model, params), one)
        return loss, loss.detach()


class _Functional(nn.Module):
    """The model called with the transform's parameters (``functional_call``)."""

    def __init__(self, model: nn.Module, params: dict[str, Tensor]) -> None:
        super().__init__()
        self.model, self.params = model, params

    def forward(self, **batch: Tensor) -> Any:
        return functional_call(self.model, self.params, (), batch)


def _first_non_finite_param(model: nn.Module, step: int) -> Finding | None:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return Finding(step, 0, "param", name, "produced")
    return None


@pytest.mark.parametrize("model", MODELS)
def test_per_sample_training_keeps_nand_on_and_trains_as_without_it(model, caplog):
    bare = PerSampleLoop(model, watched=False, lr_fault=False).train()
    with caplog.at_level(logging.WARNING, logger="nand"):
        run = PerSampleLoop(model, watched=True, lr_fault=False).train()
    assert run.watch is not None and not run.watch._guard.off
    assert run.watch.events == []
    assert run.losses == bare.losses and all(map(math.isfinite, run.losses))
    told = [r.getMessage() for r in caplog.records if "torch.func transform" in r.getMessage()]
    assert len(told) == 1  # said once, not at every hook


@pytest.mark.parametrize("model", MODELS)
def test_an_overflowing_update_after_per_sample_gradients_names_the_parameter(model):
    truth = PerSampleLoop(model, watched=False, lr_fault=True).train().first_bad_param
    assert truth is not None and truth.step == FAULT_STEP
    run = PerSampleLoop(model, watched=True, lr_fault=True).train()
    assert run.watch is not None and not run.watch._guard.off
    assert where(run.watch.first) == truth
