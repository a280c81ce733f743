"""Values made by code written inline in a parent's ``forward``.

Hooks fire when a module *finishes*, so a value computed between two children
(``x = self.fc1(x) * 2 + bias``) has no module of its own. It reaches the next
child as an input that is not the output recorded last: that input is probed
as the parent's ("inline"), so the parent is blamed, not the child.

One relu/gelu/silu/tanh/sigmoid of the last recorded output is not probed: it
cannot be non-finite unless that output was. ReLU's backward zeroes the
gradient where the input was cut, which can hide a NaN the consumer made
there; its gradient probe waits (:meth:`InlineCheck.defer`) until the consumer
is known, and is dropped when the consumer's backward is benign.

An input probed already at its current version (a module's output that a
second consumer reads: ``q(x)``, ``k(x)``, ``v(x)`` after a norm) is not
probed again as the parent's: its value is known, and in backward a second
hook on the same gradient would fire after the producer's, so a non-finite
gradient made by the producer's own consumer (the norm's input gradient)
would be blamed on the parent. :data:`PROBED` marks the tensors probed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from nand.agent.detect.grads import GradHooks
from nand.agent.detect.modules import ModuleInfo
from nand.agent.detect.probes import Site
from nand.agent.detect.state import HookState

#: Autograd nodes of elementwise ops that cannot make a finite value
#: non-finite, when written inline (``F.relu(self.linear1(x))``); of those, the
#: ones whose backward zeroes gradients where the input was cut.
FINITE_NODES = frozenset(
    {"ReluBackward0", "GeluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0"}
)
#: Those that also keep an allowed -inf finite (gelu(-inf) and silu(-inf) are
#: -inf * 0 = NaN): used when some module may emit -inf (``allow_nonfinite``).
NEGINF_SAFE_NODES = frozenset({"ReluBackward0", "TanhBackward0", "SigmoidBackward0"})
MASKING_NODES = frozenset({"ReluBackward0"})
#: The attribute that marks a probed tensor with the version it was probed at.
PROBED = "_nand_probed"


def finite_op_of(
    x: Tensor, last: Tensor | None, nodes: frozenset[str] = FINITE_NODES
) -> str | None:
    """The node name if ``x`` is one finite-preserving op applied to ``last``.

    ``last`` was probed (or is such an op of a probed value itself), so ``x``
    is finite whenever ``last`` is: probing it again would only re-read the
    same bytes (an 8 MB activation in a transformer's feed-forward block).
    """
    node = x.grad_fn
    # ``last`` changed in place since it was probed (by inline code): not covered.
    if node is None or last is None or last.grad_fn is None or last._version:
        return None
    name = node.name()
    if name not in nodes:
        return None
    nexts = node.next_functions
    if len(nexts) != 1 or nexts[0][0] is not last.grad_fn or nexts[0][1] != last.output_nr:
        return None
    return name


class InlineCheck:
    """The inline-code check of one watch's hooks."""

    def __init__(
        self,
        state: HookState,
        probe_output: Callable[[Site, Tensor], None],
        grad_hook: Callable[[Site], GradHooks],
    ) -> None:
        self.state = state
        self.probe_output = probe_output  # probe a value and its gradient
        self.grad_hook = grad_hook  # the gradient hooks of a site
        #: NEGINF_SAFE_NODES once some module may emit -inf on purpose.
        self.finite_nodes = FINITE_NODES

    def check_inputs(
        self, args: tuple[Any, ...], output: Any, info: ModuleInfo, module: nn.Module
    ) -> None:
        """Probe inputs that are not the last recorded output, as the parent's.

        Only values that require grad: those derive from the model's
        activations. A tensor that does not (an attention mask full of -inf
        on purpose, built inline from constants or from the data) is not a
        candidate for "the parent's code made it non-finite". So under
        ``no_grad`` inline code is not told apart from the next child.

        A module with forward pre-hooks of its own (other than nand's) may
        have had its inputs changed by them: those belong to the module's
        call, so the value is the module's, not its parent's.

        A DTensor is passed over: a tensor-parallel layer's input hook made it
        from the value it was given (an all-gather may have brought other
        ranks' parts into it), and probing it would reduce across the ranks;
        the layer's output is checked (``tensor_parallel.py``).

        A value that is one relu/gelu/silu/tanh/sigmoid of the last recorded
        output cannot be non-finite unless that output was: no forward probe
        (relu keeps its gradient probe unless its consumer's backward is
        benign, see :data:`MASKING_NODES` and :meth:`settle`).
        """
        last = self.state.last
        owner: ModuleInfo | None = None
        for x in args:
            if (
                isinstance(x, Tensor)
                and x is not last
                and x is not output
                and x.requires_grad
                and x.is_floating_point()
                and x.numel()
                and getattr(x, "_local_tensor", None) is None  # (not a DTensor: see above)
                and getattr(x, PROBED, None) != x._version  # (probed already: see the module)
            ):
                if owner is None:
                    nands = 0 if info.leaf else 1  # containers carry nand's pre-hook
                    own = len(module._forward_pre_hooks) > nands
                    owner = info if own or info.parent is None else info.parent
                node = finite_op_of(x, last, self.finite_nodes)
                if node is None:
                    self.probe_output(owner.inline_site(), x)
                elif node in MASKING_NODES:
                    # Its backward can hide a NaN the next module made (see
                    # modules.MASKING): the gradient is probed, unless this
                    # module, its consumer, has a benign backward.
                    site = owner.inline_site().backward
                    assert site is not None
                    if info.benign:
                        pass  # nothing it does in backward lines up with the cut
                    elif info.leaf and not info.safe:
                        self.grad_hook(site).attach(x)  # this leaf consumes it
                    else:  # a container or finite-preserving module passes it on
                        self.defer(x, self.grad_hook(site))

    def defer(self, value: Tensor, hooks: GradHooks) -> None:
        """Hold a masking value's gradient probe until its consumer is known."""
        if self.state.pending is not None:
            self.settle(None, ())
        self.state.pending = (value, hooks.attach)

    def settle(self, consumer: ModuleInfo | None, args: tuple[Any, ...]) -> None:
        """The pending masking value reaches ``consumer`` (``None``: unknown code).

        A finite-preserving module passes it on (its output carries the same
        cut positions); a module with a benign backward needs no probe in
        between; anything else, the probe is attached.
        """
        pending = self.state.pending
        assert pending is not None
        self.state.pending = None
        value, attach = pending
        if consumer is not None and len(args) == 1 and args[0] is self.state.last:
            if consumer.safe:
                self.state.pending = pending
                return
            if consumer.benign:
                return
        attach(value)
