"""Planted faults with a known ground truth, for the demo and the e2e tests.

A fault spec is ``KIND[:key=value...]``, e.g. ``overflow:rank=2:step=40``.

=============  ==================================================================
kind           what happens on ``rank`` at optimizer step ``step``
=============  ==================================================================
overflow       ``module``'s output grows 10^5 per step over the 8 steps before
               ``step`` and reaches +inf at ``step`` (forward, produced)
nan_forward    ``module``'s output gets a NaN at ``step`` (forward, produced)
nan_backward   the gradient flowing out of ``module`` becomes NaN at ``step``,
               although its forward stays finite (backward, produced)
bad_data       the input batch holds a NaN at ``step`` (input, data); needs a
               model with float inputs (``--model mlp``)
lr_explosion   every rank's learning rate becomes inf at ``step`` (a scheduler
               that divided by zero): the parameters go non-finite on all
               ranks at once (param, simultaneous)
bad_shard      ``rank``'s optimizer step writes +inf into its own part of
               ``module``'s weight at ``step`` (its FSDP shard, or its DDP
               replica): param on that rank; the others receive it through the
               next step's all-gather (FSDP) or gradient all-reduce (DDP)
drift          after ``rank``'s optimizer step at ``step``, one element of
               ``module``'s weight gains 0.01: finite, and that replica now
               differs from the others (a silent data corruption; DDP)
bitflip        the same, but the lowest mantissa bit of one element flips
state_drift    the same as drift, in the optimizer's first per-element state
               of ``module``'s weight (AdamW's ``exp_avg``), not the weight
=============  ==================================================================

The hooks planted here are registered *before* ``nand.watch``, so nand sees
what they did exactly as it would see a real layer misbehave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

KINDS = (
    "overflow",
    "nan_forward",
    "nan_backward",
    "bad_data",
    "lr_explosion",
    "bad_shard",
    "drift",
    "bitflip",
    "state_drift",
)
#: Kinds planted by a step post-hook on the optimizer (``plant_in_optimizer``).
WRITTEN_AFTER_STEP = ("bad_shard", "drift", "bitflip", "state_drift")
BUILD_UP_STEPS = 8


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = 0
    step: int = 10
    module: str = ""

    @classmethod
    def parse(cls, spec: str) -> Fault:
        kind, *pairs = spec.split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; choose from {', '.join(KINDS)}")
        fields: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in ("rank", "step", "module"):
                raise ValueError(f"bad fault field {pair!r}: use rank=N, step=N or module=NAME")
            fields[key] = value
        return cls(
            kind=kind,
            rank=int(fields.get("rank", 0)),
            step=int(fields.get("step", 10)),
            module=fields.get("module", ""),
        )

    def applies_to(self, rank: int) -> bool:
        return self.kind == "lr_explosion" or rank == self.rank


class _StepClock:
    """The optimizer step the planted hooks compare against (set by the trainer)."""

    def __init__(self) -> None:
        self.step = 0


class _PoisonGradient(torch.autograd.Function):
    """Identity forward; NaN gradient backward: a bug that exists only in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def plant(fault: Fault, model: nn.Module, rank: int) -> _StepClock:
    """Install ``fault``'s hooks on ``model`` (unwrapped); returns the clock to advance."""
    clock = _StepClock()
    if not fault.applies_to(rank) or fault.kind in (
        "bad_data",
        "lr_explosion",
        *WRITTEN_AFTER_STEP,
    ):
        return clock
    module = model.get_submodule(fault.module)
    if fault.kind == "overflow":
        module.register_forward_hook(_overflow_hook(fault, clock))
    elif fault.kind == "nan_forward":
        module.register_forward_hook(_nan_output_hook(fault, clock))
    elif fault.kind == "nan_backward":
        module.register_forward_pre_hook(_poison_input_hook(fault, clock))
    return clock


def _overflow_hook(fault: Fault, clock: _StepClock):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        steps_left = fault.step - clock.step
        if steps_left < 0 or steps_left > BUILD_UP_STEPS:
            return None
        scale = 1e40 if steps_left == 0 else 10.0 ** (5 * (BUILD_UP_STEPS - steps_left) // 2)
        # The gradient stays that of the identity: only the values blow up,
        # the way an unstable layer's activations do.
        return output + (scale - 1.0) * output.detach()

    return hook


def _nan_output_hook(fault: Fault, clock: _StepClock):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if clock.step != fault.step:
            return None
        poisoned = output.clone()
        poisoned.view(-1)[0] = float("nan")
        return poisoned

    return hook


def _poison_input_hook(fault: Fault, clock: _StepClock):
    def hook(module: nn.Module, args: tuple) -> tuple | None:
        if clock.step != fault.step or not args:
            return None
        return (_PoisonGradient.apply(args[0]), *args[1:])

    return hook


def poison_batch(fault: Fault | None, rank: int, step: int, inputs: torch.Tensor) -> torch.Tensor:
    """The ``bad_data`` fault: one NaN in this rank's batch at the planted step."""
    if fault is None or fault.kind != "bad_data" or rank != fault.rank or step != fault.step:
        return inputs
    if not inputs.is_floating_point():
        raise ValueError("bad_data needs float inputs: use --model mlp")
    inputs = inputs.clone()
    inputs.view(-1)[0] = float("nan")
    return inputs


def maybe_explode_lr(fault: Fault | None, step: int, optimizer: torch.optim.Optimizer) -> None:
    if fault is not None and fault.kind == "lr_explosion" and step == fault.step:
        for group in optimizer.param_groups:
            group["lr"] = float("inf")


def plant_in_optimizer(
    fault: Fault | None, optimizer: torch.optim.Optimizer, model: nn.Module, rank: int, clock
) -> None:
    """``bad_shard``, ``drift``, ``bitflip``, ``state_drift``: a step post-hook,
    registered before nand's own."""
    if fault is None or fault.kind not in WRITTEN_AFTER_STEP or rank != fault.rank:
        return
    weight: Any = model.get_submodule(fault.module).weight  # a Tensor, or an FSDP2 DTensor

    def corrupt(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if clock.step == fault.step:
            with torch.no_grad():
                local = weight.to_local() if hasattr(weight, "to_local") else weight
                if fault.kind == "bad_shard":
                    local.view(-1)[0] = float("inf")
                elif fault.kind == "drift":
                    local.view(-1)[0] += 0.01
                elif fault.kind == "state_drift":
                    moments = opt.state[weight].values()
                    state = next(t for t in moments if t.shape == weight.shape)  # exp_avg
                    state.view(-1)[0] += 0.01
                else:  # bitflip: the lowest mantissa bit (float32)
                    local.view(-1).view(torch.int32)[0] ^= 1

    optimizer.register_step_post_hook(corrupt)
