"""The torch calls between the model's return and the backward: a loss, to replay.

A loss computed in the user's own loop (``F.cross_entropy(model(x), y)``, a
hand-written one) runs outside the model, where no hook sees it. From the
root module's return to the backward that starts from the loss (or the next
root call, or the step's boundary), :class:`CallRecorder`, a
``TorchFunctionMode``, notes each torch call that makes a tensor: the
function, its arguments with each tensor an earlier call made (or the
model's output) replaced by a reference to it, and the user's line that
called it. Nothing is copied and nothing read from the device; tensors that
come from elsewhere (the labels, a mask) are kept by reference. The result,
a :class:`LossPlan`, is held with the micro-step; on a loss incident the
replay runs the model again and then the plan on its output
(:meth:`LossPlan.run`), under the op watch.

The mode is entered only when no other torch-function mode but the default
device's is on the stack (one entered by the user around the forward would
be popped in its place), and is taken off the stack wherever it is.
At most :data:`MAX_CALLS` calls are recorded: a longer computation (logging
code that reads tensors) is not replayed, and costs no more than that.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext
from torch.utils._pytree import tree_flatten, tree_unflatten

from nand.agent.rerun.source import calling_line

#: Calls recorded at most between a root return and the backward.
MAX_CALLS = 64
_compiling = torch.compiler.is_dynamo_compiling
_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_push = torch._C._push_on_torch_function_stack
_pop = torch._C._pop_torch_function_stack
#: Tensor methods that change their tensor in place and return nothing.
_IN_PLACE = frozenset({"__setitem__"})


@dataclasses.dataclass(frozen=True, slots=True)
class Made:
    """A tensor an earlier call made: call ``call``'s output leaf ``leaf``
    (``call`` -1: the model's output leaf ``leaf``)."""

    call: int
    leaf: int


#: A model that returned one tensor: its output.
_MODEL_OUTPUT = Made(-1, 0)


@dataclasses.dataclass(slots=True)
class Call:
    func: Any
    spec: Any  # of (args, kwargs), leaves with Made for the tensors made before
    leaves: list[Any]
    line: str


@dataclasses.dataclass(slots=True)
class LossPlan:
    """The recorded loss computation of one micro-step: ``calls`` in order,
    the last one's output ``loss`` (a :class:`Made`) is what the backward started from."""

    output_spec: Any
    calls: list[Call]
    loss: Made

    def run(self, output: Any, before: Any = None) -> tuple[Tensor, dict[Any, str]]:
        """Run the calls again on the model's (replayed) ``output``; ``before(line)``
        is told each call's line first (the op watch names it). Returns the
        loss, and the line of each autograd node the calls made (for its backward)."""
        model_leaves, spec = _flatten(output)
        if spec != self.output_spec:
            raise ValueError("the replayed model's output is not shaped as the step's was")
        made: dict[int, list[Any]] = {-1: model_leaves}  # (call -1: the model's output)
        lines: dict[Any, str] = {}
        for i, call in enumerate(self.calls):
            leaves = [made[x.call][x.leaf] if isinstance(x, Made) else x for x in call.leaves]
            args, kwargs = _unflatten(leaves, call.spec)
            if before is not None:
                before(call.line)
            made[i] = _flatten(call.func(*args, **kwargs))[0]
            for t in made[i]:
                if isinstance(t, Tensor) and t.grad_fn is not None:
                    lines.setdefault(t.grad_fn, call.line)
        return made[self.loss.call][self.loss.leaf], lines


class CallRecorder(TorchFunctionMode):
    """Records one micro-step's loss computation (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.calls: list[Call] = []
        self.full = False
        self._spec: Any = None
        self._made: dict[int, tuple[weakref.ref[Tensor], Made]] = {}

    def start(self, output: Any) -> None:
        """The root returned ``output``: record from here (where the mode stack allows)."""
        if self.on:
            self.stop()
        depth = _stack_len()  # (0 mostly: no mode of anyone's)
        for i in range(depth):
            if not isinstance(_stack_at(i), DeviceContext):
                return
        if isinstance(output, Tensor):  # (most models: no walk)
            self._made[id(output)], self._spec = (weakref.ref(output), _MODEL_OUTPUT), None
        else:
            leaves, self._spec = _flatten(output)
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, Tensor):
                    self._made[id(leaf)] = (weakref.ref(leaf), Made(-1, i))
        _push(self)
        self.on = True

    def stop(self, loss: Tensor | None = None) -> LossPlan | None:
        """Take the mode off the stack; the plan that made ``loss``, if it was recorded."""
        if not self.on:
            return None
        self.on = False
        above = []
        while _stack_len():
            mode = _pop()
            if mode is self:
                break
            above.append(mode)
        for mode in reversed(above):
            _push(mode)
        found = self._made.get(id(loss)) if loss is not None and not self.full else None
        calls, spec = self.calls, self._spec
        self.calls, self._made, self.full = [], {}, False
        if found is None or found[0]() is not loss:
            return None
        return LossPlan(spec, calls, found[1])

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.full or _compiling():
            return out
        try:  # (one Python frame per call recorded: this is paid on every healthy step)
            if isinstance(out, Tensor):
                outs: list[Any] = [out]
            else:
                outs = tree_flatten(out)[0]
                if not _has_tensor(outs) and func.__name__ not in _IN_PLACE:
                    return out  # (a size, a dtype, a float: its value is in the calls using it)
            if len(self.calls) >= MAX_CALLS:
                self.full = True
                return out
            leaves = [*args, *kwargs.values()]
            spec: Any = (_FLAT, len(args), tuple(kwargs))
            for leaf in leaves:  # (inline, not a call: this runs on every healthy step)
                if isinstance(leaf, _CONTAINERS):
                    leaves, spec = tree_flatten((args, kwargs))
                    break
            made = self._made
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, Tensor):
                    found = made.get(id(leaf))
                    if found is not None and found[0]() is leaf:
                        leaves[i] = found[1]
            index = len(self.calls)
            self.calls.append(Call(func, spec, leaves, calling_line(sys._getframe(1))))
            for j, t in enumerate(outs):
                if isinstance(t, Tensor):
                    made[id(t)] = (weakref.ref(t), Made(index, j))
        except Exception:  # (a value pytree cannot flatten: this step is not replayed)
            self.full = True
        return out


def _has_tensor(values: list[Any]) -> bool:
    # (a loop, not any() of a generator: a frame less, on every step)
    for value in values:  # noqa: SIM110
        if isinstance(value, Tensor):
            return True
    return False


#: The spec of a call whose arguments hold no container (most: tensors and numbers).
_FLAT = "flat"
_CONTAINERS = (tuple, list, dict)


def _flatten(value: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, without its walk for a lone tensor (most outputs)."""
    if isinstance(value, Tensor):
        return [value], None
    return tree_flatten(value)


def _unflatten(leaves: list[Any], spec: Any) -> Any:
    """``(args, kwargs)`` again from the leaves :func:`_flatten_call` gave."""
    if isinstance(spec, tuple) and spec[:1] == (_FLAT,):
        _, n, keys = spec
        return tuple(leaves[:n]), dict(zip(keys, leaves[n:], strict=True))
    return tree_unflatten(leaves, spec)
