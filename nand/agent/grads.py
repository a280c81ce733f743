"""Gradient probes: what runs inside ``backward``, one per probed forward value.

Backward order is the reverse of forward; the analysis in
:mod:`nand.agent.step_check` blames the module whose gradient fired just
before the first non-finite one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.compiler import is_dynamo_compiling as is_compiling
from torch.utils.hooks import RemovableHandle

from nand.agent.probes import Site

if TYPE_CHECKING:
    from nand.agent.hooks import HookState

_FLOAT32, _aminmax = torch.float32, torch.aminmax


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

        def tensor_hook(grad: Tensor) -> None:
            if guard.off:
                return
            try:
                # The gradient of a probed float output: float and non-empty
                # too; it does not require grad (no create_graph): no detach.
                probe(grad, site)
            except Exception as exc:
                guard.failed(exc, f"gradient hook of {site.module!r}")

        def node_hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            # (tensor_hook's body, not a call to it: see OptimizerHooks._pre on calls)
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
            t.register_hook(self.tensor_hook)


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

        return self.bias.register_hook(received)


def read_together(state: HookState, chain: list[BiasProxy]) -> RemovableHandle:
    """One hook for the bias proxies of a chain: read them all at its start.

    ``chain`` are the proxies of an exact ``nn.Sequential``'s children, in
    call order, when nothing else of nand's runs in backward (see
    ``Hooks.install``). Their order in backward is then known, the reverse,
    and one hook can probe them all: on the bias of the first, after its
    gradient is accumulated. The engine runs a parameter's accumulation as
    soon as its gradient is ready, so by then every later bias holds its own.
    Each call from the autograd engine into Python costs ~20k instructions on
    CPU (the probe itself a fraction): one per backward instead of one per
    proxy. For the same reason the probes are written out, not called.

    The values are read from ``.grad`` after accumulation: under gradient
    accumulation, the sum so far; a non-finite value still shows first in the
    micro-step that made it.
    """
    buf, guard = state.buf, state.guard
    probe, pairs, sites = buf.probe, buf.pairs, buf.sites
    backward_order = [(proxy, proxy.bias, proxy.site) for proxy in reversed(chain)]

    def read(_: Tensor) -> None:
        if guard.off:
            return
        micro = state.micro
        try:
            eager = not is_compiling()  # (first: dynamo would guard on len())
            for proxy, bias, site in backward_order:
                grad = bias.grad
                if proxy.armed == micro and grad is not None:
                    proxy.armed = -1
                    if (
                        eager
                        and (k := len(pairs)) < buf.room
                        and grad.dtype is _FLOAT32
                        and grad.device == buf.device
                    ):  # ProbeBuffer.probe's slab path, written out (see Hooks._leaf_hook)
                        into = buf.slots[k : k + 2]
                        _aminmax(grad, out=into)
                        pairs.extend(into)
                        sites.append(site)
                    else:
                        probe(grad, site)
        except Exception as exc:
            guard.failed(exc, "gradient hook of the chain's biases")

    return chain[0].bias.register_post_accumulate_grad_hook(read)
