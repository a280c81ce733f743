"""The loss computation of a micro-step: seen at its backward, replayed on an incident.

:class:`LossSteps` listens to ``Tensor.backward`` while the watch is open
(``patches.listen_to_backward``) and hands each loss a backward starts from
to the step boundary, whose one read checks it (``step/losses.py``): a
non-finite loss is an incident whatever the gradients.

Where micro-steps are root calls (not a framework's ``step``, which runs
the loss itself: Lightning's ``training_step``), the torch calls from the
root's return to that backward are recorded (``recorder.py``: two hooks on
the root, a ``TorchFunctionMode`` in between) and the plan that made the
loss is held with the micro-step. A loss the model returned (an HF model
given ``labels=``) is a plan of no call. A replay of a loss event
(:class:`LossRun`) runs the plan on the replayed model's output, under the
op watch, each call named by the user's line that made it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from nand.agent import patches
from nand.agent.detect.savable import SavableHook
from nand.agent.rerun.held import Held
from nand.agent.rerun.opwatch import LOSS, OpWatch
from nand.agent.rerun.recorder import CallRecorder, LossPlan
from nand.agent.safety import Guard
from nand.agent.step.boundary import Boundary

_compiling = torch.compiler.is_dynamo_compiling
#: Why a loss event of a step whose loss computation was not recorded is not replayed.
NOT_RECORDED = (
    "not replayed: the loss computation was not recorded (another torch-function mode "
    f"was active, it made more than {CallRecorder.__module__.rsplit('.', 1)[-1]}.MAX_CALLS "
    "calls, or its backward did not start from a tensor it made)"
)


class LossSteps:
    """The watch's ears on ``Tensor.backward``, and the recorder of losses."""

    def __init__(self, guard: Guard, boundary: Boundary) -> None:
        self.guard = guard
        self.boundary = boundary
        self.recorder = CallRecorder()
        self.held: Held | None = None
        self._unlisten: Callable[[], None] | None = None
        self._handles: list[RemovableHandle] = []

    def install(self, root: nn.Module, held: Held | None) -> None:
        """Listen to backwards; with ``held`` (replays on), record losses too."""
        self._unlisten = patches.listen_to_backward(self._backward)
        self.held = held
        if held is not None:
            held.recorder = self.recorder  # (stopped when the root is called again)
            self._handles = [  # (a saved or copied model takes it as a no-op: savable.py)
                root.register_forward_hook(SavableHook(self._returned)),
            ]
        self.boundary.losses.recorder = self.recorder  # (stopped when a window is read)

    def remove(self) -> None:
        self._stop()
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _returned(self, module: nn.Module, args: Any, output: Any) -> None:
        held = self.held
        if held is None or held.paused or held.off or self.guard.off or not held.steps:
            return
        if _compiling():  # (a compiled root: nothing is held of it, see held.py)
            return
        if held._state.external_batches or not torch.is_grad_enabled():
            return  # (a framework's step runs its loss itself; no backward without grad)
        try:
            self.recorder.start(output)
        except Exception as exc:
            self._stop()
            self.guard.failed(exc, "loss recording")

    def _stop(self) -> None:
        try:
            self.recorder.stop()
        except Exception as exc:
            self.guard.failed(exc, "loss recording")

    def _backward(self, loss: Tensor) -> None:
        """A backward starts from ``loss``: the boundary checks it (no device
        work); the plan that made it is held with its micro-step."""
        if self.guard.off:
            return
        try:
            plan = self.recorder.stop(loss) if self.recorder.on else None
            held = self.held
            if plan is not None and held is not None and held.steps:
                step = held.steps[-1]
                step.loss = step.loss or plan
            self.boundary.losses.backward_from(loss)
        except Exception as exc:
            self.guard.failed(exc, "loss at backward")


class LossRun:
    """Runs a held loss plan after the replayed forward (``run.replay``'s ``then``)."""

    def __init__(self, plan: LossPlan | None) -> None:
        self.plan = plan

    def __call__(self, output: Any, watch: OpWatch) -> None:
        if self.plan is None:  # (a framework's step: its loss ran with the forward)
            return
        try:
            loss, watch.node_lines = self.plan.run(
                output, lambda line: setattr(watch, "user_call", LOSS + line)
            )
        finally:
            watch.user_call = ""
        if loss.requires_grad and bool(torch.isfinite(loss.detach()).all()):
            # A finite loss whose gradient is not (acos at 1, sqrt at 0): its backward,
            # as far as the model's outputs, names the op.
            outputs = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.grad(loss, outputs, allow_unused=True)
