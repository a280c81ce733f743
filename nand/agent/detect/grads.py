"""Gradient probes: what runs inside ``backward``, one per probed forward value.

Backward order is the reverse of forward; the analysis in
:mod:`nand.agent.step.analysis` blames the module whose gradient fired just
before the first non-finite one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from nand.agent.detect.modules import ModuleInfo
from nand.agent.detect.probes import Site
from nand.agent.detect.state import HookState


def register_tensor_hook(t: Tensor, hook: Callable[[Tensor], Tensor | None]) -> RemovableHandle:
    """``t.register_hook(hook)``, typed (torch leaves that method unannotated)."""
    register: Callable[[Callable[[Tensor], Tensor | None]], RemovableHandle] = t.register_hook
    return register(hook)


class GradHooks:
    """Probes the gradient of a forward value when backward reaches it.

    The hook goes on the autograd node that made the value (a node pre-hook:
    it receives the gradient w.r.t. that node's outputs before the node runs),
    which the engine calls about 10 µs cheaper than a ``Tensor.register_hook``
    hook on CPU. Values without a node (leaves) or that are not their node's
    first output fall back to a tensor hook. Both see the gradient that flows
    into the value, also when an in-place op changed the tensor afterwards.
    """

    __slots__ = ("node_hook", "tensor_hook")

    def __init__(self, state: HookState, site: Site) -> None:
        probe, guard = state.buf.probe, state.guard

        def tensor_hook(grad: Tensor | None) -> None:
            # None: an output of a compiled graph that the loss did not use
            # (aot_autograd calls its hook with no gradient; eager code does not).
            if grad is None or guard.off:
                return
            try:
                # The gradient of a probed float output: float and non-empty
                # too; it does not require grad (no create_graph): no detach.
                probe(grad, site)
            except Exception as exc:
                guard.failed(exc, f"gradient hook of {site.module!r}")

        def node_hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            grad = grad_outputs[0]
            if grad is None or guard.off:
                return
            try:
                probe(grad, site)
            except Exception as exc:
                guard.failed(exc, f"gradient hook of {site.module!r}")

        self.tensor_hook = tensor_hook
        self.node_hook = node_hook

    def attach(self, t: Tensor) -> None:
        node = t.grad_fn
        if node is not None and t.output_nr == 0:
            node.register_prehook(self.node_hook)
        else:
            register_tensor_hook(t, self.tensor_hook)


class BiasProxy:
    """Reads a module's output gradient from its bias gradient: no hook per call.

    For a Linear, convolution or norm, ``bias.grad`` is the output gradient
    summed over every position but the channel: non-finite exactly when the
    output gradient is (short of the sum overflowing). A tensor hook registered
    once on the bias (:meth:`listen`) probes the gradient arriving for it (this
    micro-step's, before it is added to ``.grad``); the engine runs the bias's
    accumulation as soon as the module's backward is done, so the entry lands
    where a probe on the output gradient would (just after the module's
    backward instead of just before it, with nothing of nand's in between).
    That spares registering a hook on every call's output, and reducing a
    large gradient (a feed-forward block's 8 MB) to a vector's.

    It stands for the module's *first* call in a micro-step: a second call's
    output gets a real probe, and the bias's gradient then holds the first
    call's part plus one already probed. Under
    ``torch.compile`` the forward hooks take real probes (the compiled backward
    would accumulate every bias at its end, out of order).
    """

    __slots__ = ("armed", "bias", "site")

    def __init__(self, site: Site, bias: Tensor) -> None:
        self.site = site
        self.bias = bias
        #: The micro-step whose first call this proxy stands for: the module's
        #: forward hook arms it (outside ``torch.compile``, where reading the
        #: micro-step counter would make dynamo guard on it, a recompile a step).
        self.armed = -1

    def listen(self, state: HookState) -> RemovableHandle:
        """Probe the bias gradient as it arrives, with a hook of its own."""
        probe, guard, site = state.buf.probe, state.guard, self.site

        def received(grad: Tensor) -> None:
            if self.armed != state.micro or guard.off:
                return  # not proxied this micro-step (compiled, or called under no_grad)
            self.armed = -1
            try:
                probe(grad, site)
            except Exception as exc:
                guard.failed(exc, f"gradient hook of {site.module!r}")

        return register_tensor_hook(self.bias, received)


class _RootHooks(Protocol):
    state: HookState

    def _grad_hook(self, site: Site) -> GradHooks: ...


def loss_probe(hooks: _RootHooks, info: ModuleInfo, slot: str, t: Tensor) -> GradHooks | None:
    """The root's probe of the gradient arriving at its output ``t`` (named
    ``slot``), or None where the root's forward hook gives it none: the same
    test as that hook's loop (a float, non-empty output, not the last child's
    output, not in slot mode). The held step's hook calls it (``rerun/held.py``)."""
    state = hooks.state
    if state.slots.active or t is state.last or not t.is_floating_point() or not t.numel():
        return None
    return hooks._grad_hook(info.loss_site(slot))
