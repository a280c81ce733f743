"""The light mode meets ``torch.compile`` on a torch without ``set_stance``.

From torch 2.6 a compiled model stays light and its replay runs eagerly
(``eager.py``); this module is for the torches before it. Compiled code
runs the hooks it saw when dynamo traced the model; hooks
added later are ignored (dynamo does not guard on them), so a replay with
probes added after the fact could not name a layer of a compiled model, and
nor could a switch to the full mode after an incident. The light mode
therefore turns full at the first compiled call, *while dynamo traces it*:
a forward pre-hook on the root calls :func:`_switch_at_trace_time`, which
dynamo runs once as plain Python (``assume_constant_result``) before it
traces the root's ``forward``. It hooks every module there and then, so the
graph dynamo compiles holds the full mode's probes (in slot mode, see
``compiled.py``): the compiled run gives the full mode's events from its
first step, at the cost of the full mode's probes. In eager code the
pre-hook is one test per root call.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nand.agent.detect.savable import SavableHook

_is_compiling = torch.compiler.is_dynamo_compiling

#: Every live switch by its key (dynamo hands a trace-time function constants only).
_live: weakref.WeakValueDictionary[str, CompileSwitch] = weakref.WeakValueDictionary()
_keys = itertools.count()


class CompileSwitch:
    """Calls ``go_full`` once, at trace time, when ``root`` is first compiled."""

    def __init__(self, root: nn.Module, go_full: Callable[[], None]) -> None:
        self.go_full = go_full
        self.key = f"switch-{next(_keys)}"
        _live[self.key] = self
        hook = SavableHook(self._pre(root))
        #: Removed with the watch's other hooks (``Hooks.handles``).
        self.handle = root.register_forward_pre_hook(hook, prepend=True)

    def _pre(self, owner: nn.Module) -> Callable[..., None]:
        key = self.key

        def switch_when_compiled(module: nn.Module, args: Any) -> None:
            if _is_compiling() and module is owner:
                _switch_at_trace_time(key)

        return switch_when_compiled


def _switch(key: str) -> int:
    switch = _live.get(key)
    if switch is not None:
        switch.go_full()
    return 0


_assume_constant_result: Callable[[Callable[[str], int]], Callable[[str], int]] = (
    torch._dynamo.assume_constant_result
)
#: :func:`_switch`, run by dynamo as plain Python when it traces the root's pre-hooks.
_switch_at_trace_time = _assume_constant_result(_switch)
