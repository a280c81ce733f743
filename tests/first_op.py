"""Ground truth without nand: the first aten op that makes a non-finite value.

A plain ``TorchDispatchMode``: the first op whose floating inputs are all
finite and whose output is not, and the user's line on the stack then. The
loss tests (tests/agent/test_loss.py, tests/integrations/test_loss_frameworks.py)
compare nand's replay with it.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: torch's files and the standard library's.
_OUTSIDE = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.__file__) + os.sep)


def outside_torch(filename: str) -> bool:
    """The innermost line that is neither torch's nor the standard library's."""
    return not filename.startswith(_OUTSIDE)


class FirstOp(TorchDispatchMode):
    """``found``: (op, ``path:line``) of the first op that made a non-finite
    value from finite inputs; the line is the innermost frame whose file
    ``is_users`` accepts (this module's own frames are never the user's)."""

    def __init__(self, is_users: Callable[[str], bool] = outside_torch) -> None:
        super().__init__()
        self.is_users = is_users
        self.found: tuple[str, str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = "empty" in func._schema.name  # (memory not written yet: no value)
        if self.found is None and not fresh and finite((args, kwargs)) and not finite(out):
            if not all(
                math.isfinite(x) for x in tree_leaves((args, kwargs)) if isinstance(x, float)
            ):
                return out  # an infinity the code wrote (an attention mask): on purpose
            name = f"{func._schema.name}.{func._overloadname}".removesuffix(".default")
            stack = traceback.extract_stack()
            user = [f for f in stack if f.filename != __file__ and self.is_users(f.filename)]
            self.found = (name, f"{user[-1].filename}:{user[-1].lineno}")
        return out


def finite(value: Any) -> bool:
    """Whether every floating tensor in ``value`` (any nesting) is finite."""
    return all(
        bool(torch.isfinite(t).all())
        for t in tree_leaves(value)
        if isinstance(t, Tensor) and t.is_floating_point()
    )
