"""Gradient probes: what runs inside ``backward``, one per probed forward value.

Backward order is the reverse of forward; the analysis in
:mod:`nand.agent.step_check` blames the module whose gradient fired just
before the first non-finite one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nand.agent.probes import Site

if TYPE_CHECKING:
    from nand.agent.hooks import HookState


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
        pairs, sites, guard = state.buf.pairs, state.buf.sites, state.guard

        def tensor_hook(grad: Tensor) -> None:
            if guard.off:
                return
            try:
                # The gradient of a probed float output: float and non-empty
                # too; it does not require grad (no create_graph): no detach.
                pairs.extend(torch.aminmax(grad))
                sites.append(site)
            except Exception as exc:
                guard.failed(exc, f"gradient hook of {site.module!r}")

        def node_hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            grad = grad_outputs[0]
            if grad is not None:
                tensor_hook(grad)

        self.tensor_hook = tensor_hook
        self.node_hook = node_hook

    def attach(self, t: Tensor) -> None:
        node = t.grad_fn
        if node is not None and t.output_nr == 0:
            node.register_prehook(self.node_hook)
        else:
            t.register_hook(self.tensor_hook)
