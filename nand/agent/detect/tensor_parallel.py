"""Each rank's own part of a tensor-parallel reduction, checked before it.

Under tensor parallelism (``parallelize_module`` with ``RowwiseParallel``,
``ColwiseParallel``...) a layer's result is the sum of every rank's partial
result: DTensor holds it as a ``Partial`` placement and the layer's hooks
reduce it (an all-reduce into ``Replicate``, a reduce-scatter into
``Shard``). A +inf made on one rank reaches every rank there:

- forward: a row-parallel layer's output, reduced by the output hook that
  ``distribute_module`` registered on the layer;
- backward: the gradient of a column-parallel layer's replicated input,
  reduced where DTensor's ``from_local`` hands it back
  (``_FromTorchTensor.backward``).

To tell the rank that made the value from the ranks that received it, nand
looks at this rank's partial result just before the reduction: a forward
hook registered *before* DTensor's own (``prepend=True``) and a tensor hook
on the layer's DTensor input, whose gradient still holds the partial sums.
One reduction each (``aminmax``, non-finite exactly when the part is), kept on
the device; read only on a step whose first finding is such a layer's (see
:meth:`TensorParallelCheck.settle`). Models without a tensor-parallel layer
get no hook.

Example::

    check = TensorParallelCheck.install(infos, hooks)  # None: no tensor-parallel layer
    ...  # forward and backward run
    records = check.take()  # at the step boundary, with the window
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from nand.agent.safety import Guard
from nand.events import VIA_TP_ALL_REDUCE, VIA_TP_GRAD_ALL_REDUCE

if TYPE_CHECKING:
    from nand.agent.detect.hooks import Hooks
    from nand.agent.detect.modules import ModuleInfo

#: Said in a finding that the check turned into ``received``.
RECEIVED_NOTE = "this rank's own partial result was finite before the reduction"


@dataclasses.dataclass(frozen=True, slots=True)
class Partial:
    """This rank's part of one reduction: where, and its (min, max) (0-d, on the device)."""

    module: str
    phase: str  # "forward" or "backward"
    micro: int  # root calls so far when it was taken (``HookState.micro``)
    extremes: tuple[Tensor, ...]


def tensor_parallel_modules(root: nn.Module) -> list[nn.Module]:
    """The modules ``distribute_module`` (so ``parallelize_module``) prepared."""
    return [m for m in root.modules() if getattr(m, "_distribute_module_applied", False)]


def is_partial(t: Any) -> bool:
    """Whether ``t`` is a DTensor whose placements include a pending reduction."""
    placements = getattr(t, "placements", None)
    return placements is not None and any(p.is_partial() for p in placements)


def _extremes(t: Any) -> tuple[Tensor, ...]:
    """(min, max) of this rank's part, kept on the device: one ``aminmax``
    pass (several times faster than ``abs().amax()`` on CPU); NaN and
    infinities reach one of them."""
    local: Tensor = t._local_tensor.detach()
    return tuple(torch.aminmax(local)) if local.numel() else ()


class TensorParallelCheck:
    """The partial results of this rank's tensor-parallel layers, per step."""

    def __init__(self, names: dict[nn.Module, str], micro: Callable[[], int], guard: Guard) -> None:
        self.names = names
        self.micro = micro  # root calls so far
        self.guard = guard
        self.partials: list[Partial] = []

    @classmethod
    def install(
        cls, infos: dict[nn.Module, ModuleInfo], hooks: Hooks
    ) -> TensorParallelCheck | None:
        """The check on the watched model's tensor-parallel layers (``infos``:
        its modules), or None (there are none); its handles join ``hooks``',
        removed with them."""
        layers = [m for m in infos if getattr(m, "_distribute_module_applied", False)]
        if not layers:
            return None
        state = hooks.state
        names = {module: info.name for module, info in infos.items()}
        check = cls(names, lambda: state.micro, state.guard)
        for layer in layers:
            hooks.handles.append(layer.register_forward_hook(check._before_reduce, prepend=True))
            hooks.handles.append(layer.register_forward_pre_hook(check._watch_input_grads))
        return check

    def take(self, micro_steps: int, micro_base: int) -> list[Partial]:
        """The partials taken in the window that ends now (``micro_steps``
        root calls, the first of them micro-step ``micro_base``), each
        labelled with its micro-step as the analysis counts them; resets."""
        taken, self.partials = self.partials, []
        before = self.micro() - micro_steps + 1  # (root calls up to the window's first)
        return [dataclasses.replace(p, micro=p.micro - before + micro_base) for p in taken]

    def _before_reduce(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward, before DTensor's output hook reduces the partial sums."""
        if self.guard.off or not is_partial(output):
            return
        try:
            self._keep(module, "forward", output)
        except Exception as exc:
            self.guard.failed(exc, "the tensor-parallel forward check")

    def _watch_input_grads(self, module: nn.Module, args: Any) -> None:
        """After DTensor's input hook: a gradient into a replicated input
        arrives as partial sums, reduced when it leaves the layer."""
        if self.guard.off:
            return
        try:
            micro = self.micro()
            for arg in args:
                if getattr(arg, "placements", None) is not None and arg.requires_grad:
                    arg.register_hook(self._grad_hook(module, micro))
        except Exception as exc:
            self.guard.failed(exc, "the tensor-parallel backward check")

    def _grad_hook(self, module: nn.Module, micro: int) -> Callable[[Tensor], None]:
        def before_reduce(grad: Tensor) -> None:
            if self.guard.off or not is_partial(grad):
                return
            try:
                self._keep(module, "backward", grad, micro)
            except Exception as exc:
                self.guard.failed(exc, "the tensor-parallel backward check")

        return before_reduce

    def _keep(self, module: nn.Module, phase: str, t: Any, micro: int | None = None) -> None:
        name = self.names.get(module, "")
        at = self.micro() if micro is None else micro
        self.partials.append(Partial(name, phase, at, _extremes(t)))


class Settled(Protocol):
    """What :func:`received_through_tp` reads and settles (``analysis.Finding``)."""

    module: str
    phase: Any
    micro: int
    cause: Any
    note: str
    via: str


def received_through_tp(finding: Settled, partials: list[Partial]) -> None:
    """A tensor-parallel layer's non-finite result whose own part on this rank
    was finite came from another rank's part: ``finding`` becomes
    ``received``, through the reduction (``via``)."""
    if not partials or finding.cause not in ("produced", "propagated"):
        return
    if finding.phase not in ("forward", "backward"):
        return
    if finite_parts(partials, finding.module, finding.phase, finding.micro) is not True:
        return  # none taken there, or this rank's own part was not finite: made here
    finding.cause = "received"
    finding.via = VIA_TP_ALL_REDUCE if finding.phase == "forward" else VIA_TP_GRAD_ALL_REDUCE
    finding.note = f"{finding.note}; {RECEIVED_NOTE}" if finding.note else RECEIVED_NOTE


def finite_parts(partials: list[Partial], module: str, phase: str, micro: int) -> bool | None:
    """Whether this rank's partial results at ``module``/``phase``/``micro``
    were all finite (None: none was taken there). One host read, on a step
    that already went non-finite."""
    here = [p for p in partials if (p.module, p.phase, p.micro) == (module, phase, micro)]
    if not here:
        return None
    figures = [x.float().reshape(1) for p in here for x in p.extremes]
    return not figures or bool(torch.isfinite(torch.cat(figures)).all().item())
