"""What every hook of one watch shares (:class:`HookState`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

from nand.agent.detect.compiled import CompiledSlots
from nand.agent.detect.probes import ProbeBuffer
from nand.agent.safety import Guard


class LossProbe(Protocol):
    """The root's probe of the gradient arriving at one output (``grads.GradHooks``)."""

    def node_hook(self, grad_outputs: tuple[Tensor | None, ...], /) -> None: ...

    def tensor_hook(self, grad: Tensor | None, /) -> None: ...


#: The loss probe the root gives output ``t`` (named ``path``), or None.
LossProbes = Callable[[str, Tensor], LossProbe | None]


class Holder(Protocol):
    """What the root's hooks call to hold a micro-step for a replay
    (``rerun.held.Held``; typed here: the detect layer imports no rerun)."""

    def hold_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...

    def hold_gradients(self, output: Any, probes: LossProbes | None = None) -> set[int]: ...

    def hold_batch(self, batch: Any, step: Callable[[Any], Tensor] | None) -> None: ...


class HookState:
    """What the hooks share: the buffer, the last recorded output, the guard.

    ``pending`` is a masking value (a relu's output) whose gradient probe waits
    for its consumer: the first hook to see it as its input decides (see
    :meth:`InlineCheck.settle`).
    """

    __slots__ = (
        "before_root",
        "buf",
        "depth",
        "external_batches",
        "guard",
        "held",
        "last",
        "micro",
        "pending",
        "pipelined",
        "slots",
        "window_full",
    )

    def __init__(
        self,
        buf: ProbeBuffer,
        guard: Guard,
        slots: CompiledSlots,
        *,
        before_root: Callable[[], None] | None = None,
        window_full: Callable[[], None] | None = None,
    ) -> None:
        self.buf = buf
        self.guard = guard
        #: Where probes go once any hook ran under torch.compile (see compiled.py).
        self.slots = slots
        self.last: Tensor | None = None
        #: (the value, the call that attaches its gradient probe)
        self.pending: tuple[Tensor, Callable[[Tensor], None]] | None = None
        self.micro = 0  # root forward calls so far (not counted under torch.compile)
        #: Watched forwards running (the root, containers; not leaves): none
        #: when a module's hook runs makes it an entry point (entry.py).
        self.depth = 0
        #: Without an optimizer, each root call ends the last step: its boundary.
        self.before_root = before_root
        #: The buffer passed :data:`MAX_WINDOW` entries: read it now.
        self.window_full = window_full
        #: Micro-steps are marked by ``Watch.new_batch``, not by root calls.
        self.external_batches = False
        #: What the root's hooks hold for a replay (``rerun.held.Held``), if anything.
        self.held: Holder | None = None
        #: The root runs as a pipeline stage (``pipeline.py``): no bias proxies.
        self.pipelined = False
