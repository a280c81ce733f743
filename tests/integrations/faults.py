"""Faults planted in real models, the way bugs and bad data would make them.

Install a :class:`Planted` *before* ``nand.watch`` (and before a
:class:`~tests.integrations.truth.Truth`): torch runs forward hooks in the
order they were registered, so the hooks registered after it see the final
output, as they would a layer that really went bad. The training loop calls
:meth:`Planted.arm` at the start of each micro-step and passes the batch, the
loss and the optimizer through it; only the armed micro-step is changed.

Arming writes a value into a 0-d tensor instead of flipping a Python flag: a
model compiled with the fault in place then sees the same graph every step
(dynamo would guard on a flag and recompile when it changes).

=========  ==========================================================  ========
kind       what is planted (``where``)                                  phase
=========  ==========================================================  ========
forward    one element of the module's output becomes the value         forward
backward   the module's output gets an identity whose backward writes   backward
           the value into the gradient: the module's backward turns a
           finite gradient non-finite
input      one element of the batch's float tensor (``where``: its key)  input
loss       the loss is multiplied by the value (a finite forward)        loss
lr         the learning rate of the parameter's own group becomes inf:   param
           its next update overflows
=========  ==========================================================  ========
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
KINDS = ("forward", "backward", "input", "loss", "lr")
#: The phase each kind of fault shows up in first.
PHASE = dict(zip(KINDS, ("forward", "backward", "input", "loss", "param"), strict=True))
#: A learning rate blown up by a bad schedule. Infinite, not merely huge: AdamW
#: divides it by a bias correction < 1, and a finite lr whose step size passes
#: float32's limit is refused by torch (``value cannot be converted``).
INF_LR = float("inf")


@dataclasses.dataclass(frozen=True)
class Fault:
    """What to plant, where, and at which (step, micro-step)."""

    kind: str
    step: int
    where: str = ""  # module (forward, backward), parameter (lr) or batch key (input)
    value: str = "nan"
    micro: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.value not in VALUES:
            raise ValueError(f"unknown fault {self.kind!r} with value {self.value!r}")


def poison(t: Tensor, value: Tensor) -> Tensor:
    """``t`` with ``value`` added to its first element (``value`` is 0 when disarmed)."""
    extra = torch.zeros_like(t, memory_format=torch.contiguous_format)
    extra.view(-1)[0] = value
    return t + extra


class BadGradient(torch.autograd.Function):
    """Identity in forward; in backward, ``value`` is added to the gradient's first element."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor) -> Tensor:
        ctx.save_for_backward(value)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (value,) = ctx.saved_tensors
        return poison(grad, value), None


def map_first(output: Any, fn: Any) -> Any:
    """``output`` with ``fn`` applied to its first floating-point tensor."""
    if isinstance(output, Tensor):
        return fn(output) if output.is_floating_point() else output
    if isinstance(output, tuple) and output:
        return (map_first(output[0], fn), *output[1:])
    if isinstance(output, dict) and output:  # ModelOutput keeps its class
        key = next(iter(output))
        changed = output.copy()
        changed[key] = map_first(output[key], fn)
        return changed
    raise TypeError(f"cannot plant a fault in an output of type {type(output).__name__}")


class Planted:
    """A :class:`Fault` installed in one model; ``remove()`` takes its hook off."""

    def __init__(self, fault: Fault | None, model: nn.Module) -> None:
        self.fault = fault
        self.armed = False
        device = next(model.parameters()).device  # a framework may move the model later
        self._value = torch.zeros((), device=device)  # the fault's value while armed, else 0
        self._factor = torch.ones((), device=device)  # the loss factor: the value while armed
        self._handle = None
        if fault is not None and fault.kind in ("forward", "backward"):
            module = model.get_submodule(fault.where)
            self._handle = module.register_forward_hook(self._forward_hook)

    def arm(self, step: int, micro: int = 0) -> None:
        """Called at the start of each micro-step: armed at the fault's only."""
        fault = self.fault
        self.armed = fault is not None and (step, micro) == (fault.step, fault.micro)
        value = VALUES[fault.value] if self.armed and fault is not None else None
        self._value.fill_(0.0 if value is None else value)
        self._factor.fill_(1.0 if value is None else value)

    def batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        if not self._is("input"):
            return batch
        assert self.fault is not None
        return {**batch, self.fault.where: poison(batch[self.fault.where], self._value)}

    def loss(self, loss: Tensor) -> Tensor:
        return loss * self._factor.to(loss.device, loss.dtype) if self._is("loss") else loss

    def before_update(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Before ``optimizer.step()`` of ``step``: the lr fault's group gets its learning rate."""
        if self.fault is None or self.fault.kind != "lr" or step != self.fault.step:
            return
        for group in optimizer.param_groups:
            if group.get("name") == self.fault.where:
                group["lr"] = INF_LR

    @property
    def value(self) -> Tensor:
        """The 0-d tensor that holds the fault's value while armed (else 0)."""
        return self._value

    def remove(self) -> None:
        """Remove the forward hook (a test moving the fault into a forward does so first)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _is(self, kind: str) -> bool:
        return self.fault is not None and self.fault.kind == kind

    def _forward_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        value = self._value
        if self._is("forward"):
            return map_first(output, lambda t: poison(t, value.to(t.device, t.dtype)))
        return map_first(output, lambda t: BadGradient.apply(t, value.to(t.device, t.dtype)))


def param_groups(model: nn.Module, isolate: str | None = None) -> list[dict[str, Any]]:
    """Optimizer groups: ``isolate`` (a parameter's name) alone in a group of its own.

    An lr fault raises that group's learning rate only, so exactly one
    parameter overflows and the ground truth is unambiguous.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rest = [p for n, p in named if n != isolate]
    groups: list[dict[str, Any]] = [{"params": rest, "name": "rest"}]
    if isolate is not None:
        groups.insert(0, {"params": [dict(named)[isolate]], "name": isolate})
    return groups
