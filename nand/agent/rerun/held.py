"""What a micro-step keeps so that it can be run again: :class:`HeldStep`.

Two hooks on the root module, device work none:

- a forward **pre-hook** keeps references to the root's inputs (positional
  and keyword), the RNG states at the call (CPU, and the model's CUDA device:
  the generator's seed and offset, read on the host without a sync) and the
  autocast state the call ran under;
- a forward **hook** puts a tensor hook on each float output that requires a
  gradient: it keeps a reference to the gradient that arrives there in
  backward (the loss computation's, already scaled by a GradScaler and
  divided for accumulation: exactly what the step's backward started from).
  Only the first gradient to arrive is kept: a gradient penalty's loss is
  made of a first backward (``autograd.grad`` with ``create_graph``), which
  a replay runs again from there; the second arrives through it.

Nothing is copied: the batch is the user's tensor, the gradient autograd's
(of a model that returns its 0-d loss, only that loss's: see ``_seeded``).
At most :data:`MAX_HELD` micro-steps of a step are held.
They are released at the first root call after the step's window was read. Buffers
are not kept per step: see :mod:`nand.agent.rerun.state`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from nand.agent.detect.grads import register_tensor_hook
from nand.agent.detect.probes import iter_tensors
from nand.agent.detect.savable import SavableHook

log = logging.getLogger("nand")
_is_compiling = torch.compiler.is_dynamo_compiling
_any_autocast = torch._C._is_any_autocast_enabled  # one call where most runs have none
#: Micro-steps held per step at most (an evaluation loop between two
#: optimizer steps calls the model many times: its batches are not all kept).
MAX_HELD = 16
#: The autocast device types a forward may run under.
AUTOCAST_DEVICES = ("cpu", "cuda")


class HeldStep:
    """One root call: its inputs, RNG and autocast state, and the gradients
    that arrived at its outputs (``grads``: output path -> gradient)."""

    __slots__ = ("args", "autocast", "cuda_rng", "grads", "kwargs", "rng")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> None:
        self.args = args
        self.kwargs = kwargs
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = _autocast() if _any_autocast() else {}
        self.grads: dict[str, Tensor] = {}

    def keep_grad(self, path: str) -> Callable[[Tensor], None]:
        def kept(grad: Tensor) -> None:
            self.grads.setdefault(path, grad)  # the first backward's (see the module)

        return kept


def _seeded(output: Any) -> list[tuple[str, Tensor]]:
    """The outputs whose gradient is held: a model that returns its loss
    (0-d) beside the logits made of it gets the loss's only. The logits'
    gradient came through the loss (held, it would cost a logits-sized
    tensor per micro-step); a loss of yours that also used the logits
    directly is then replayed without that part."""
    found = [
        (path, t) for path, t in iter_tensors(output) if t.requires_grad and t.is_floating_point()
    ]
    losses = [(path, t) for path, t in found if t.dim() == 0]
    return losses or found


def _autocast() -> dict[str, torch.dtype]:
    return {
        kind: torch.get_autocast_dtype(kind)
        for kind in AUTOCAST_DEVICES
        if torch.is_autocast_enabled(kind)
    }


class Held:
    """The micro-steps of the current step, in order, for one root module.

    ``paused`` while a replay runs: the replayed root call is not a micro-step.
    A hook that fails (an RNG state that cannot be read, say) turns holding
    off for good, with one warning: a replay then says the step was not held.
    """

    def __init__(self, root: nn.Module, device: torch.device, reads: Callable[[], int]) -> None:
        self.steps: list[HeldStep] = []
        self.paused = False
        self.off = False  # a hook failed
        self.device = device
        #: The boundary's host reads so far: one more since the last micro-step
        #: held means that step's window was read, and its micro-steps are over.
        self._reads = reads
        self._read_at = -1
        self._handles: list[Any] = [
            root.register_forward_pre_hook(SavableHook(self._pre(root)), with_kwargs=True),
            root.register_forward_hook(SavableHook(self._post(root))),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.steps.clear()

    def _pre(self, owner: nn.Module) -> Callable[..., None]:
        def hold_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.paused or self.off or module is not owner or _is_compiling():
                return
            try:
                reads = self._reads()
                if reads != self._read_at:  # a new window: the last one's steps are over
                    self.steps.clear()
                    self._read_at = reads
                if len(self.steps) < MAX_HELD:  # (the first ones: their index is the micro-step)
                    self.steps.append(HeldStep(args, kwargs, self.device))
            except Exception as exc:
                self._failed(exc)

        return hold_inputs

    def _post(self, owner: nn.Module) -> Callable[..., None]:
        def hold_gradients(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self.paused or self.off or module is not owner or _is_compiling() or not self.steps:
                return
            held = self.steps[-1]
            try:
                for path, t in _seeded(output):
                    register_tensor_hook(t, held.keep_grad(path))
            except Exception as exc:
                self._failed(exc)

        return hold_gradients

    def _failed(self, exc: Exception) -> None:
        log.warning("nand: replay off, the step's inputs cannot be held: %r", exc)
        self.off = True
        self.steps.clear()
