"""The plain training loop of the suite, in the ways people really train.

One :class:`Loop` is one run: a real model from :mod:`zoo`, AdamW, an
optional fault from :mod:`faults`, and one observer — the ground truth
(:class:`~tests.integrations.truth.Truth`, no nand), nand, or nothing. A test
runs the same loop twice, once with each, and compares: the truth's first
finding is the answer nand must give, and the losses must be the same.

For example, the answer for a NaN planted in GPT-2's forward at step 2, and
what nand says of the same run::

    fault = Fault("forward", 2, "transformer.h.1.mlp.c_proj")
    truth = expected("gpt2", FP32, fault, steps=4).truth.first
    watch = with_nand("gpt2", FP32, fault, steps=4).watch
    assert where(watch.first) == truth
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import nand
from nand.events import Event
from tests.integrations.faults import Fault, Planted, param_groups
from tests.integrations.truth import Finding, Truth
from tests.integrations.zoo import Case, case, float_input_needed

LR = 1e-3
#: Where every twin run trains: ``NAND_TEST_DEVICE=cuda`` runs the suite on a
#: GPU (nand then reads one boundary late, without a sync), CPU by default.
DEVICE = torch.device(os.environ.get("NAND_TEST_DEVICE", "cpu"))


@dataclasses.dataclass(frozen=True)
class Mode:
    """How the loop trains: precision, scaler, accumulation, checkpointing, closure."""

    name: str
    autocast: torch.dtype | None = None
    scaler: str = ""  # "" (none), "passed" (scaler= given to nand) or "not passed"
    init_scale: float = 2.0**16
    accum: int = 1
    checkpointing: bool = False
    closure: bool = False  # forward and backward inside optimizer.step(closure)
    compile: str = ""  # a torch.compile backend, compiled after nand.watch
    #: A gradient penalty's weight: the loss gets the squared norm of its own
    #: gradients, taken with ``create_graph`` (a second backward through them).
    penalty: float = 0.0
    #: ``backward(create_graph=True)``, as Hessian-based optimizers train:
    #: every ``.grad`` is then a tensor autograd records.
    create_graph: bool = False

    def __str__(self) -> str:
        return self.name


FP32 = Mode("fp32")
BF16 = Mode("bf16", autocast=torch.bfloat16)
FP16_SCALER_PASSED = Mode("fp16-scaler-passed", autocast=torch.float16, scaler="passed")
FP16_SCALER_NOT_PASSED = Mode("fp16-scaler-not-passed", autocast=torch.float16, scaler="not passed")
CHECKPOINTING = Mode("checkpointing", checkpointing=True)
ACCUMULATION = Mode("accumulation", accum=3)
CLOSURE = Mode("closure", closure=True)
GRADIENT_PENALTY = Mode("gradient-penalty", penalty=1e-3)
CREATE_GRAPH = Mode("create-graph", create_graph=True)


class Loop:
    """One training run; its model, optimizer and observer stay for the asserts."""

    def __init__(
        self,
        case_name: str,
        mode: Mode,
        fault: Fault | None = None,
        observer: str = "",  # "", "truth" or "nand"
        prepare: Callable[[nn.Module, Planted], None] | None = None,
        **watch_options: Any,
    ) -> None:
        self.case: Case = case(case_name)
        self.mode = mode
        self.fault = fault
        self.float_input = fault is not None and float_input_needed(self.case, fault.kind)
        self.model = self.case.build().to(DEVICE)
        if mode.checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()  # renamed in transformers 5
        isolate = fault.where if fault is not None and fault.kind == "lr" else None
        self.optimizer = torch.optim.AdamW(param_groups(self.model, isolate), lr=LR)
        self.scaler = (
            torch.amp.GradScaler(DEVICE.type, init_scale=mode.init_scale) if mode.scaler else None
        )
        self.planted = Planted(fault, self.model)  # before any observer: see faults.py
        if prepare is not None:  # the user's changes to the model come before nand's hooks
            prepare(self.model, self.planted)
        self.truth = Truth(self.model, self.optimizer) if observer == "truth" else None
        self.watch: nand.Watch | None = None
        if observer == "nand":
            scaler = self.scaler if mode.scaler == "passed" else None
            self.watch = nand.watch(self.model, self.optimizer, scaler=scaler, **watch_options)
        self.run = torch.compile(self.model, backend=mode.compile) if mode.compile else self.model
        self.losses: list[float] = []
        self.step = 0

    def train(self, steps: int) -> Loop:
        torch.manual_seed(1)  # dropout draws the same masks in every twin run
        for _ in range(steps):
            self.one_step()
        return self

    def one_step(self) -> None:
        if self.mode.closure:
            self._update(self._closure)
        else:
            for micro in range(self.mode.accum):
                self._forward_backward(micro)
            self._update(None)
        self.optimizer.zero_grad()
        if self.truth is not None:
            self.truth.end_step()
        self.step += 1

    def close(self) -> None:
        self.planted.remove()
        if self.truth is not None:
            self.truth.close()
        if self.watch is not None:
            self.watch.close()

    @property
    def params_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def _closure(self) -> Tensor:
        self.optimizer.zero_grad()
        return self._forward_backward(0)

    def _forward_backward(self, micro: int) -> Tensor:
        self.planted.arm(self.step, micro)
        index = self.step * self.mode.accum + micro
        batch = self.planted.batch(on_device(self.case.batch(index, self.float_input)))
        with self._autocast(), self._attention_kernels():
            loss = self.planted.loss(self.case.loss(self.run, batch))
        self.losses.append(loss.detach().float().item())
        if self.mode.penalty:
            loss = loss + self.mode.penalty * self._squared_grad_norm(loss)
        loss = loss / self.mode.accum
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward(create_graph=self.mode.create_graph)
        return loss

    def _squared_grad_norm(self, loss: Tensor) -> Tensor:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        return sum((g.pow(2).sum() for g in grads if g is not None), loss.new_zeros(()))

    def _attention_kernels(self) -> AbstractContextManager[None]:
        # A penalty differentiates the backward, and CUDA's fused attention
        # kernels have no double backward: the math kernel has (on CPU too).
        if not self.mode.penalty:
            return nullcontext()
        return sdpa_kernel([SDPBackend.MATH])

    def _autocast(self) -> torch.autocast:
        dtype = self.mode.autocast
        return torch.autocast(DEVICE.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def _update(self, closure: Any) -> None:
        self.planted.before_update(self.optimizer, self.step)
        if self.scaler is None:
            self.optimizer.step(closure)
        else:  # GradScaler takes no closure
            self.scaler.step(self.optimizer)
            self.scaler.update()


def on_device(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {key: value.to(DEVICE) for key, value in batch.items()}


def where(event: Event | None) -> Finding | None:
    """What nand said, in the truth's terms."""
    if event is None:
        return None
    return Finding(event.step, event.micro_step, event.phase, event.module, event.cause)


def expected(
    case_name: str,
    mode: Mode,
    fault: Fault | None,
    steps: int,
    prepare: Callable[[nn.Module, Planted], None] | None = None,
) -> Loop:
    """The run with the ground truth and without nand: its ``truth.first`` is the answer."""
    loop = Loop(case_name, mode, fault, observer="truth", prepare=prepare)
    try:
        return loop.train(steps)
    finally:
        loop.close()


def with_nand(
    case_name: str,
    mode: Mode,
    fault: Fault | None,
    steps: int,
    prepare: Callable[[nn.Module, Planted], None] | None = None,
    **options: Any,
) -> Loop:
    """The same run with nand watching and no ground truth."""
    loop = Loop(case_name, mode, fault, observer="nand", prepare=prepare, **options)
    try:
        return loop.train(steps)
    finally:
        loop.close()
