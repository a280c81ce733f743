"""What a micro-step keeps so that it can be run again: :class:`HeldStep`.

Called from nand's own root hooks (``detect/hooks.py``: no module hook
of its own, one dispatch less per call), device work none:

- in the forward **pre-hook** it keeps references to the root's inputs (positional
  and keyword), the RNG states at the call (CPU, and the model's CUDA device:
  the generator's seed and offset, read on the host without a sync) and the
  autocast state the call ran under, and the plain attributes of the
  model's own modules (``attrs``);
- in the forward **hook** it puts a hook on the autograd node of each float
  output that requires a gradient (a node pre-hook, which the engine calls
  cheaper than a tensor hook; a tensor hook where the output is not its
  node's first): it keeps a reference to the gradient that arrives there in
  backward (the loss computation's, already scaled by a GradScaler and
  divided for accumulation: exactly what the step's backward started from).
  Only the first gradient to arrive is kept: a gradient penalty's loss is
  made of a first backward (``autograd.grad`` with ``create_graph``), which
  a replay runs again from there; the second arrives through it. The same
  hook calls the root's probe of that gradient (the ``loss`` phase's): one
  registration and one call from autograd into Python a step, not two
  (``benchmarks/root_checks.py``: a few µs on CPU);
- in ``Watch.new_batch`` with a framework's ``step`` (Lightning's), the batch
  and that step instead, which returns the loss its backward started from
  (a replay seeds it with ones); root calls are not held then.

Nothing is copied: the batch is the user's tensor, the gradient autograd's
(of a model that returns its 0-d loss, only that loss's: see ``_seeded``).
At most :data:`MAX_HELD` micro-steps of a step are held.
They are released at the first root call after the step's window was read
(deferred, ``keep_earlier``: the window after it, whose boundary reads the
step's window one step late). Buffers are not kept per step: see
:mod:`nand.agent.rerun.state`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from nand.agent.detect.grads import register_tensor_hook
from nand.agent.detect.probes import iter_tensors
from nand.agent.detect.state import HookState, LossProbe, LossProbes
from nand.agent.rerun.attrs import HeldAttrs, take
from nand.agent.rerun.recorder import LossPlan
from nand.agent.rerun.source import calling_line

log = logging.getLogger("nand")
_is_compiling = torch.compiler.is_dynamo_compiling
_any_autocast = torch._C._is_any_autocast_enabled  # one call where most runs have none
_cpu_generator = torch.default_generator
#: Micro-steps held per step at most (an evaluation loop between two
#: optimizer steps calls the model many times: its batches are not all kept).
MAX_HELD = 16
#: The autocast device types a forward may run under.
AUTOCAST_DEVICES = ("cpu", "cuda")


class HeldStep:
    """One root call: its inputs, RNG and autocast state, and the gradients
    that arrived at its outputs (``grads``: output path -> gradient). Or one
    batch with the framework's ``step`` that runs it again (see :meth:`Held.hold_batch`)."""

    __slots__ = (
        "args",
        "attrs",
        "autocast",
        "cuda_rng",
        "grads",
        "kwargs",
        "line",
        "loss",
        "rng",
        "step",
    )

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        cuda: torch.device | None,
        attrs: HeldAttrs | None = None,
        step: Callable[[Any], Tensor] | None = None,
    ) -> None:
        """``cuda``: the model's CUDA device, whose RNG state is held too (None: on CPU)."""
        self.args = args
        self.step = step
        self.kwargs = kwargs
        self.attrs = attrs  # the modules' plain values (see attrs.py)
        self.rng = _cpu_generator.get_state()  # (what torch.get_rng_state calls)
        self.cuda_rng = torch.cuda.get_rng_state(cuda) if cuda is not None else None
        self.autocast = _autocast() if _any_autocast() else {}
        self.grads: dict[str, Tensor] = {}
        self.line = calling_line(sys._getframe(1))  # where the user called the model
        self.loss: LossPlan | None = None  # its loss computation, recorded (``recorder.py``)

    def keep_grad(self, path: str, t: Tensor, probe: LossProbe | None = None) -> None:
        """Keep the gradient that arrives at output ``t`` (named ``path``);
        ``probe``: the root's loss probe of ``t``, called by the same hook
        (one hook less for autograd to register and call, see the module)."""
        grads, node = self.grads, t.grad_fn
        if node is not None and t.output_nr == 0:
            then_node = probe.node_hook if probe is not None else None

            def kept_at_node(grad_outputs: tuple[Tensor | None, ...]) -> None:
                if grad_outputs[0] is not None:
                    grads.setdefault(path, grad_outputs[0])  # the first backward's
                if then_node is not None:
                    then_node(grad_outputs)

            node.register_prehook(kept_at_node)
        else:
            then = probe.tensor_hook if probe is not None else None

            def kept(grad: Tensor | None) -> None:
                if grad is not None:  # (None: a compiled graph's unused output)
                    grads.setdefault(path, grad)  # the first backward's (see the module)
                if then is not None:
                    then(grad)

            register_tensor_hook(t, kept)


def _seeded(output: Any) -> list[tuple[str, Tensor]]:
    """The outputs whose gradient is held: a model that returns its loss
    (0-d) beside the logits made of it gets the loss's only. The logits'
    gradient came through the loss (held, it would cost a logits-sized
    tensor per micro-step); a loss of yours that also used the logits
    directly is then replayed without that part."""
    if isinstance(output, Tensor):  # (most models: no walk)
        return [("", output)] if output.requires_grad and output.is_floating_point() else []
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
    The root's hooks call :meth:`hold_inputs` and :meth:`hold_gradients`
    (they find this object in ``state.held``), after their own work.
    """

    def __init__(
        self,
        state: HookState,
        device: torch.device,
        reads: Callable[[], int],
        dicts: list[dict[str, Any]] | None = None,
        keep_earlier: bool = False,
    ) -> None:
        self.dicts = dicts or []  # of the modules whose plain attributes are held (attrs.own_dicts)
        self.steps: list[HeldStep] = []
        self.before = 0  # micro-steps of the window before (a parameter's label)
        self.paused = False
        self.off = False  # a hook failed
        self.device = device
        self._cuda = device if device.type == "cuda" else None
        #: The boundary's windows so far (read, or copied to be read): one more
        #: since the last micro-step held means that step's window is closed,
        #: and its micro-steps are over. Each window is numbered by it.
        self._reads = reads
        self._read_at = -1
        #: Deferred: the window before (its number and micro-steps), still to be read.
        self._keep_earlier = keep_earlier
        self._earlier: tuple[int, list[HeldStep]] = (-1, [])
        self._state = state
        self.recorder: Any = None  # the loss recorder (``loss.py``), if any
        state.held = self

    def remove(self) -> None:
        if self._state.held is self:
            self._state.held = None
        self.steps = []
        self._earlier = (-1, [])

    def of_window(self, window: int) -> list[HeldStep]:
        """The micro-steps held of window number ``window`` (none if gone)."""
        if window == self._read_at:
            return self.steps
        number, steps = self._earlier
        return steps if window == number else []

    def hold_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A root call starts (not under torch.compile): keep what re-runs it;
        what ran since the last call's return was no loss of that call."""
        if self.recorder is not None and self.recorder.on:
            self.recorder.stop()
        if not self._state.external_batches:  # (else a batch is the micro-step)
            self._hold(args, kwargs, None)

    def hold_batch(self, batch: Any, step: Callable[[Any], Tensor] | None) -> None:
        """``Watch.new_batch``: a framework's micro-step, which ``step(batch)``
        runs again (Lightning's closure: ``training_step`` and the loss its
        backward starts from). Without a ``step`` nothing is held."""
        if step is not None:
            self._hold((batch,), {}, step)

    def _hold(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], step: Callable[[Any], Tensor] | None
    ) -> None:
        if self.paused or self.off:
            return
        try:
            reads = self._reads()
            if reads != self._read_at:  # a new window: the last one's steps are over
                self.before = len(self.steps)
                self._earlier = (self._read_at, self.steps) if self._keep_earlier else (-1, [])
                self.steps = []
                self._read_at = reads
            if len(self.steps) < MAX_HELD:  # (the first ones: their index is the micro-step)
                attrs = take(self.dicts)
                self.steps.append(HeldStep(args, kwargs, self._cuda, attrs, step))
        except Exception as exc:
            self._failed(exc)

    def hold_gradients(self, output: Any, probes: LossProbes | None = None) -> set[int]:
        """The root call returned ``output``: keep the gradients that arrive there.

        ``probes(path, t)``: the root's loss probe of output ``t``, if it has
        one; the hook that keeps the gradient calls it too. Returns the ``id``
        of each output whose probe it took on (the root hooks it no more)."""
        taken: set[int] = set()
        if self.paused or self.off or not self.steps or self._state.external_batches:
            return taken
        held = self.steps[-1]
        try:
            for path, t in _seeded(output):
                probe = probes(path, t) if probes is not None else None
                held.keep_grad(path, t, probe)
                if probe is not None:
                    taken.add(id(t))
        except Exception as exc:
            self._failed(exc)  # (the hooks registered so far still call their probes)
        return taken

    def _failed(self, exc: Exception) -> None:
        log.warning("nand: replay off, the step's inputs cannot be held: %r", exc)
        self.off = True
        self.steps = []
        self._earlier = (-1, [])
