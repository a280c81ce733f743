"""Module hooks that a saved or copied model takes along as no-ops.

Torch keeps module hooks in the modules' ``__dict__``, so ``copy.deepcopy``
and ``torch.save`` take them along (see ``hooks.py``).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

#: What a hook of nand's becomes in a pickle or a deep copy (see SavableHook).
DORMANT_EVENT = "nand.hook: the model was copied or saved from a nand.watch; this hook does nothing"


class SavableHook(functools.partial[None]):
    """A module hook as nand hands it to torch: called like the function it
    wraps (a C call, no Python frame more), and a no-op once pickled or
    deep-copied (a closure does not pickle).

    The copy gets ``partial(sys.audit, ...)``: it takes any arguments and
    returns None (a forward hook's "leave the output alone"), needs only the
    standard library to load, and tells only an audit hook, if one is
    installed, that it was called.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial, (sys.audit, DORMANT_EVENT))
