"""The exact op: a ``TorchDispatchMode`` that looks at every aten op's outputs.

During a replay every aten op, in forward and in backward, passes through
:class:`OpWatch`. An op whose floating-point output holds a NaN or an
infinity is recorded as an :class:`OpRecord`, once it matters:

- **produced**: its floating-point inputs were all finite (an in-place op's
  inputs are looked at before it runs): this op made the value. Every such
  op is kept (up to :data:`MAX_RECORDS`), in the order they ran.
- otherwise the first op per (phase, module) to output a non-finite value:
  the value came from a non-finite input, which may be a tensor no op of
  the step made (a constant, a buffer), and the line that used it is worth
  showing.

Each record names the op (``aten::log``, ``aten::div.Tensor``), the user's
line (:mod:`~nand.agent.rerun.source`), the phase (``forward`` or
``backward``: an autograd node is running) and, in forward, the innermost
module running. Checking costs a host read per op: a replay is the slow path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nand.agent.rerun.source import (
    caller,
    innermost_module,
    stack_source,
    traceback_source,
)

#: Ops recorded at most per replay (a NaN spreading makes every op after it
#: non-finite, but only from non-finite inputs: those are recorded once per module).
MAX_RECORDS = 256


@dataclasses.dataclass(frozen=True)
class OpRecord:
    op: str  # aten::log, aten::div.Tensor
    source: str  # path:line, "" when no line of the user's was found
    phase: str  # forward | backward
    module: str | None  # forward: the innermost module running (qualified name)
    produced: bool  # from finite inputs


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


class OpWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]  # (torch's, unannotated)
    """Records the ops that output non-finite values; see the module.

    ``names``: module -> qualified name, for the forward records.
    """

    def __init__(self, names: dict[nn.Module, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names = names
        self.records: list[OpRecord] = []
        self._seen: set[tuple[str, str | None]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _floats((args, kwargs))
        mutable = func._schema.is_mutable
        finite_before = _all_finite(inputs) if mutable and self._open() else None
        out = func(*args, **kwargs)
        if not self._open():
            return out
        outputs = _floats(out)
        if not outputs or _all_finite(outputs):
            return out
        produced = finite_before if finite_before is not None else _all_finite(inputs)
        self._record(func, produced)
        return out

    def _open(self) -> bool:
        return len(self.records) < MAX_RECORDS

    def _record(self, func: Any, produced: bool) -> None:
        node = torch._C._current_autograd_node()
        phase = "forward" if node is None else "backward"
        frame = caller(2)  # the code that called the op (the caller of __torch_dispatch__)
        module = None
        if phase == "forward":
            found = innermost_module(frame)
            module = self.names.get(found) if found is not None else None
        if not produced and (phase, module) in self._seen:
            return
        self._seen.add((phase, module))
        source = stack_source(frame, __file__)
        if not source and node is not None:
            source = traceback_source(node)
        self.records.append(OpRecord(op_name(func), source, phase, module, produced))
