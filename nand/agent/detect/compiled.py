"""Probes under ``torch.compile``: one fixed slot per site, no Python state touched.

Inside a graph that dynamo traces, a hook must not append to a Python list
(dynamo guards on the list's length, so the graph would be recompiled
whenever a window's length differs at entry: every micro-step) nor read a
tensor's ``grad_fn`` (a graph break). So once any hook of a watch runs under
dynamo, every forward probe of that watch goes to a *slot* instead: a (min,
max) pair of a preallocated device vector, one pair per site, given out in
the order the sites first run. In compiled code the slot number is handed
out at trace time by a function dynamo runs once and bakes in as a constant
(``assume_constant_result``): no guard, no recompile. A probe folds into its
slot with ``minimum``/``maximum``, which carry NaN and both infinities, so
the micro-steps of a window and the calls of a reused module fold into one
figure; the slots are zeroed after each read.

Gradients inside a compiled graph cannot be probed safely: a gradient hook
compiled into the backward graph that writes into a shared tensor makes
autograd's saved-tensor check fail as soon as two graphs (or two forwards of
one) run before their backwards. So in slot mode backward is judged from the
parameters' gradients, read at the step boundary as always (see
``step.analysis.gradient_frontier``), and the event says so.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from nand.agent.detect.entry import input_slot
from nand.agent.detect.modules import ModuleInfo
from nand.agent.detect.probes import MICRO, Site, iter_tensors

#: Pairs of slots a watch can give out; a model with more sites shares the
#: last pair among the rest (detection holds, blame is coarser).
SLOTS = 4096


class CompiledSlots:
    """The slot vector of one watch, and the site of each slot.

    A probe names its site by ``(module info, input?, slot name)``: plain
    values dynamo can hand to a trace-time function.
    """

    def __init__(
        self, device: torch.device, dtype: torch.dtype, infos: Iterable[ModuleInfo]
    ) -> None:
        self.slab = torch.zeros(2 * SLOTS, device=device, dtype=dtype)
        self.sites: list[Site] = []  # by slot
        self._slot: dict[tuple[str, bool, str], int] = {}
        #: Set once any probe went here: the watch reads the slots from then on.
        self.active = False
        #: This object's name to :func:`_slot_at_trace_time` (see there).
        self.key = f"slots-{next(_keys)}"
        _live[self.key] = self
        self.infos = {info.name: info for info in infos}

    @classmethod
    def for_model(cls, root: torch.nn.Module, infos: Iterable[ModuleInfo]) -> CompiledSlots:
        """Slots on the model's device, in a dtype that holds every parameter
        dtype's range (float64 models: float64), for the sites of ``infos``."""
        params = [p for p in root.parameters() if p.is_floating_point()]
        device = params[0].device if params else torch.device("cpu")
        wide = any(p.dtype == torch.float64 for p in params)
        return cls(device, torch.float64 if wide else torch.float32, infos)

    def slot(self, info: ModuleInfo, is_input: bool, name: str, dtype: torch.dtype) -> int:
        """The offset of a site's pair in the slab, given out on first use.

        Called at trace time in compiled code (see :func:`_slot_at_trace_time`),
        directly in eager code.
        """
        key = (info.name, is_input, name)
        k = self._slot.get(key)
        if k is None:
            site = info.input_site(name) if is_input else info.output_site(name)
            # Shapes may be symbolic in a compiled graph: not recorded in slot mode.
            site.dtype, site.shape = site.dtype or dtype, None
            k = 2 * min(len(self.sites), SLOTS - 1)
            self._slot[key] = k
            if len(self.sites) < SLOTS:
                self.sites.append(site)
            self.active = True
        return k

    def record(self, t: Tensor, info: ModuleInfo, is_input: bool, name: str) -> None:
        """Fold ``t``'s min and max into its site's slot. No sync; in compiled
        code no Python state is read (the slot number is a trace-time constant)."""
        if t.device != self.slab.device or not t.is_floating_point() or not t.numel():
            return
        if torch.compiler.is_dynamo_compiling():
            k = _slot_at_trace_time(self.key, info.name, is_input, name, t.dtype)
        else:
            k = self.slot(info, is_input, name, t.dtype)
        lo, hi = torch.aminmax(t.detach())
        if info.allow_neginf and not is_input:
            lo = hi  # -inf is on purpose there: only the max is watched
        pair = self.slab[k : k + 2]
        pair.copy_(torch.stack([torch.minimum(pair[0], lo), torch.maximum(pair[1], hi)]))

    def record_outputs(self, info: ModuleInfo, output: Any) -> None:
        """Probe every float tensor of a module's ``output`` into its slot
        (forward only)."""
        for name, t in iter_tensors(output):
            self.record(t, info, False, name)

    def record_inputs(self, info: ModuleInfo, args: Any, kwargs: Any) -> None:
        """Probe every float tensor of a module's inputs into its slot."""
        for path, t in iter_tensors((args, kwargs)):
            self.record(t, info, True, input_slot(path))

    def take(self) -> tuple[list[Site | None], Tensor]:
        """This window's sites (one micro-step, in first-run order) and their
        pairs; the slots are zeroed for the next window."""
        used = 2 * len(self.sites)
        values = self.slab[:used].clone()
        self.slab[:used].zero_()
        return [MICRO, *self.sites], values


#: Every live slot vector by its key. A function dynamo runs at trace time
#: gets constants only on every torch version (2.11 refuses an object:
#: "UserDefinedObjectVariable(CompiledSlots) is not a constant"), so the
#: slots and the module are named by strings, which are never made symbolic.
_live: weakref.WeakValueDictionary[str, CompiledSlots] = weakref.WeakValueDictionary()
_keys = itertools.count()


def _slot(slots_key: str, module: str, is_input: bool, name: str, dtype: torch.dtype) -> int:
    slots = _live[slots_key]
    return slots.slot(slots.infos[module], is_input, name, dtype)


SlotOf = Callable[[str, str, bool, str, torch.dtype], int]
_assume_constant_result: Callable[[SlotOf], SlotOf] = torch._dynamo.assume_constant_result

#: :meth:`CompiledSlots.slot`, run once by dynamo when it traces a probe; the
#: number it returns is compiled in as a constant.
_slot_at_trace_time = _assume_constant_result(_slot)
