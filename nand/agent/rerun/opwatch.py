"""The exact op: a ``TorchDispatchMode`` that looks at every aten op's outputs.

During a replay every aten op, in forward and in backward, passes through
:class:`OpWatch`. An op whose floating-point output holds a NaN or an
infinity is recorded as an :class:`OpRecord`, once it matters:

- ``produced``: its floating-point inputs, tensors and Python numbers, were
  all finite (an in-place op's tensors are looked at before it runs): this
  op made the value. Every such op is kept (up to :data:`MAX_RECORDS`), in
  the order they ran.
- ``constant``: a Python number among its inputs was non-finite
  (``masked_fill(mask, -inf)``, ``torch.full(..., -inf)``): code that writes
  an infinity on purpose, an attention mask most often. Kept to be passed over.
- ``input``: a tensor input was already non-finite. The first such op per
  (phase, module) is kept: the tensor may be one no op of the step made (a
  constant tensor, a buffer), and the line that used it is worth showing.

Each record names the op (``aten::log``, ``aten::div.Tensor``), the user's
line (:mod:`~nand.agent.rerun.source`), the phase (``backward``: an autograd
node is running, grad mode off; else ``forward``, a checkpointed forward
recomputed in backward included) and, in forward, the innermost module
running; in backward, the module that made the autograd node running
(:mod:`~nand.agent.rerun.owners`). Checking costs a host read per op: a
replay is the slow path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nand.agent.rerun.owners import NodeOwners
from nand.agent.rerun.source import (
    caller,
    innermost_module,
    nands,
    stack_source,
    traceback_source,
)

#: ``OpWatch.user_call`` of a loss's calls, run by nand for the user (``recorder.py``).
LOSS = "loss:"
#: Ops recorded at most per replay (a NaN spreading makes every op after it
#: non-finite, but only from non-finite inputs: those are recorded once per module).
MAX_RECORDS = 256


#: Ops whose output is memory not written yet: whatever it holds is no value.
UNINITIALISED = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::resize_",
    }
)


@dataclasses.dataclass(frozen=True)
class OpRecord:
    op: str  # aten::log, aten::div.Tensor
    source: str  # path:line, "" when no line of the user's was found
    phase: str  # forward | backward
    module: str | None  # the innermost module running (forward), or the node's (backward)
    kind: str  # produced | constant | input (see the module)


def op_name(func: Any) -> str:
    """``aten::div.Tensor``; the default overload is left out (``aten::log``)."""
    schema = func._schema
    overload = func._overloadname
    return schema.name if overload == "default" else f"{schema.name}.{overload}"


def _floats(value: Any) -> list[Tensor]:
    return [
        t
        for t in tree_leaves(value)
        if isinstance(t, Tensor) and t.is_floating_point() and t.numel()
    ]


def _all_finite(tensors: list[Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _scalars_finite(value: Any) -> bool:
    return all(math.isfinite(x) for x in tree_leaves(value) if isinstance(x, float))


class OpWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]  # (torch's, unannotated)
    """Records the ops that output non-finite values; see the module.

    ``names``: module -> qualified name, for the forward records; ``owners``:
    the module of each node, for the backward ones.
    """

    def __init__(self, names: dict[nn.Module, str], owners: NodeOwners | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names = names
        self.owners = owners
        self.records: list[OpRecord] = []
        #: Where the user called what the replay runs now (the model, a loss
        #: function): the line of an op that has none of the user's on the stack.
        self.user_call = ""
        self.node_lines: dict[Any, str] = {}  # a replayed loss's nodes: the user's line
        self._seen: set[tuple[str, str | None, str]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _floats((args, kwargs))
        mutable = func._schema.is_mutable
        finite_before = _all_finite(inputs) if mutable and self._open() else None
        out = func(*args, **kwargs)
        if not self._open() or func._schema.name in UNINITIALISED:
            return out
        outputs = _floats(out)
        if not outputs or _all_finite(outputs):
            return out
        finite = finite_before if finite_before is not None else _all_finite(inputs)
        kind = "produced" if _scalars_finite((args, kwargs)) else "constant"
        kind = kind if finite else "input"
        self._record(func, kind)
        return out

    def _open(self) -> bool:
        return len(self.records) < MAX_RECORDS

    def _record(self, func: Any, kind: str) -> None:
        node = torch._C._current_autograd_node()
        # A checkpointed forward recomputed inside the backward runs with grad
        # mode on; the replay's own backward runs with it off (no create_graph).
        phase = "forward" if node is None or torch.is_grad_enabled() else "backward"
        frame = caller(2)  # the code that called the op (the caller of __torch_dispatch__)
        if nands(frame, __file__) and not self.user_call.startswith(LOSS):
            return  # a probe of nand's, reading a value the model made: not the model's op
        module = None
        if phase == "forward":
            found = innermost_module(frame)
            module = self.names.get(found) if found is not None else None
        elif self.owners is not None:
            module = self.owners.of(node)
        if kind != "produced" and (phase, module, kind) in self._seen:
            return
        self._seen.add((phase, module, kind))
        call = self.user_call.removeprefix(LOSS)
        source = stack_source(frame, __file__, "" if node is not None else call)
        if not source and node is not None:
            source = traceback_source(node) or self.node_lines.get(node, "") or call
        self.records.append(OpRecord(op_name(func), source, phase, module, kind))
