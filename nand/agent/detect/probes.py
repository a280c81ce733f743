"""Device-side reductions and the per-step probe buffer.

A probe is one ``torch.aminmax`` of a tensor: one pass that gives both
detection (NaN reaches min and max, +inf the max, -inf the min) and the
telemetry figure max|x| = max(max, -min). It is correct in every float dtype
and the fastest correct reduction on CPU (the CPU inf-norm is not
vectorised). The two 0-d results stay on the device; nothing here reads them.

Parameters, gradients and optimizer state are checked with one multi-tensor
``torch._foreach_norm`` (2-norm), which also gives the gradient norm. A 2-norm
of finite values can overflow to inf, so a non-finite norm is only a suspect:
the slow path in :mod:`nand.agent.step.analysis` verifies it with ``isfinite``.

The buffer's lists are cleared in place, never rebound: the hooks hold them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from operator import attrgetter
from typing import Any

import torch
from torch import Tensor
from torch.compiler import is_dynamo_compiling as is_compiling

from nand.agent.detect.stage import Handoff
from nand.events import Phase

#: Marks the start of a micro-step (a root forward call) in ``ProbeBuffer.sites``.
MICRO = None


@dataclasses.dataclass(eq=False, slots=True, kw_only=True)
class Site:
    """Where a probe was taken; one object per (module, phase, output slot).

    ``owner`` is the module the finding is blamed on: the module itself for its
    outputs, the parent for an inline value computed in the parent's forward.
    """

    phase: Phase
    module: str
    module_type: str
    index: int = -1  # position in the module table; -1 for parameters
    slot: str = ""  # output position ("0", "logits"...), state key, or input path
    kind: str = "output"  # output | inline | loss | input | norm | sample (sampling.py)
    dtype: torch.dtype | None = None  # of the last probed tensor
    shape: tuple[int, ...] | None = ()  # of the last probed tensor (None: not recorded)
    allow_neginf: bool = False  # allow-listed module: -inf is on purpose
    backward: Site | None = None  # the site of this value's gradient
    forward: Site | None = None  # for a gradient site: the site of the value
    param: Tensor | None = None  # norm sites: the parameter (its state tensor for state)


#: Values the slab holds at first, and at most (a window with more is stacked).
SLAB_START, SLAB_MAX = 64, 4096
_FLOAT32, _FLOAT64, _aminmax = torch.float32, torch.float64, torch.aminmax
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled
_DTYPE = attrgetter("dtype")
#: Dtypes that get a slab of their own beside the float32 one: autocast's and
#: pure half-precision outputs, and float64 (which float32 would round).
NARROW_AND_WIDE = (torch.bfloat16, torch.float16, torch.float64)
Positions = tuple[int, ...]


class OtherSlabs:
    """Slabs in the dtypes of :data:`NARROW_AND_WIDE`, indexed like the float32 one.

    Under autocast most activations are bfloat16 or float16, which
    ``aminmax(out=...)`` cannot write into float32. Such a probe writes its
    pair at its own position in the slab of its dtype instead, and the read
    takes each position from the slab that holds it: one ``torch.where`` per
    dtype, with masks made once per layout (a window's layout is the same
    every step). Stacking the 0-d results instead costs a conversion kernel
    for each, which on a GPU cost more than the probes themselves.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.slabs: dict[torch.dtype, tuple[Tensor, list[Tensor]]] = {}
        #: This window's pair positions, by dtype.
        self.positions: dict[torch.dtype, list[int]] = {}
        self._masks: dict[tuple[Any, ...], list[tuple[Tensor, Tensor]]] = {}

    def slots(self, dtype: torch.dtype) -> list[Tensor]:
        """The 0-d views of ``dtype``'s slab (made on first use)."""
        made = self.slabs.get(dtype)
        if made is None:
            slab = torch.zeros(self.size, device=self.device, dtype=dtype)
            made = self.slabs[dtype] = (slab, list(slab.unbind()))
        return made[1]

    def take(self, dtype: torch.dtype, k: int) -> list[Tensor] | None:
        """The pair of views at position ``k`` for a probe of ``dtype``, or None."""
        if dtype not in NARROW_AND_WIDE:
            return None
        self.positions.setdefault(dtype, []).append(k)
        return self.slots(dtype)[k : k + 2]

    def combine(self, main: Tensor, n_pairs: int, wide_norms: bool) -> Tensor:
        """``main`` (the float32 slab's first values) with every position held
        by another slab taken from there; norms at ``n_pairs`` on (float64 if
        ``wide_norms``). Promotes to the widest dtype used."""
        used = [(d, tuple(p)) for d, p in self.positions.items() if p]
        key = (len(main), n_pairs if wide_norms else -1, *used)
        masks = self._masks.get(key)
        if masks is None:
            if len(self._masks) > 64:  # layouts that keep changing: keep a few
                self._masks.clear()
            masks = self._masks[key] = self._make_masks(len(main), n_pairs, wide_norms, used)
        result = main
        for mask, slab in masks:
            result = torch.where(mask, slab[: len(main)], result)
        return result

    def clear(self) -> None:
        for positions in self.positions.values():
            positions.clear()

    def _make_masks(
        self, n: int, n_pairs: int, wide_norms: bool, used: list[tuple[torch.dtype, Positions]]
    ) -> list[tuple[Tensor, Tensor]]:
        """A mask per dtype, made on the device by ``fill_`` of runs of positions:
        a copy from the host would be a synchronising call."""
        masks = []
        dtypes = {d for d, _ in used} | ({_FLOAT64} if wide_norms else set())
        for dtype in sorted(dtypes, key=lambda d: d.itemsize):  # float64 last: it wins
            mask = torch.zeros(n, dtype=torch.bool, device=self.device)
            for start, stop in _runs(dict(used).get(dtype, ())):
                mask[start:stop].fill_(True)
            if dtype is _FLOAT64 and wide_norms:
                mask[n_pairs:].fill_(True)
            masks.append((mask, self.slabs[dtype][0]))
        return masks


def _runs(pair_positions: Positions) -> list[tuple[int, int]]:
    """The (start, stop) runs that pairs at these ascending positions cover.

    >>> _runs((0, 2, 6, 8, 12))
    [(0, 4), (6, 10), (12, 14)]
    """
    runs: list[tuple[int, int]] = []
    for k in pair_positions:
        if runs and runs[-1][1] == k:
            runs[-1] = (runs[-1][0], k + 2)
        else:
            runs.append((k, k + 2))
    return runs


class ProbeBuffer:
    """The 0-d results of one optimizer step, in execution order.

    ``pairs`` holds (min, max) per activation probe, ``sites`` the matching
    :class:`Site` (and :data:`MICRO` marks); ``norms``/``norm_sites`` hold the
    multi-tensor norms of grads, params and optimizer state.

    Probes write their (min, max) straight into a preallocated float32 vector,
    the *slab*, through 0-d views of it made once (``aminmax(out=...)``): no
    two new tensors per probe, and the step's read is one slice of the slab
    rather than a ``stack`` of every result (on CPU, stacking an MLP's 20
    results costs about what two of its probes do). ``pairs`` then holds those
    views. Half-precision and float64 values go to slabs of their own at the
    same positions (:class:`OtherSlabs`). A probe no slab can take (another
    device, no room left, under ``torch.compile``) appends results of its
    own; that window is stacked, and the slab is refitted for the next one:
    moved to the device of the window's first probe, grown to the window's
    size (up to :data:`SLAB_MAX`).
    """

    __slots__ = (
        "device",
        "exact_norms",
        "extras",
        "heads",
        "norm_sites",
        "norms",
        "others",
        "pairs",
        "pipeline",
        "room",
        "sites",
        "slab",
        "slots",
        "slotted",
        "spans",
        "spilled",
        "wide_norms",
    )

    def __init__(self) -> None:
        self.pairs: list[Tensor] = []
        self.sites: list[Site | None] = []
        self.norms: list[Tensor] = []
        self.norm_sites: list[Site] = []
        self.extras: list[Tensor] = []  # loss, AMP scale, found_inf...
        #: (start, count) among ``norms`` of the gradients ("grad") and parameters ("param").
        self.spans: dict[str, tuple[int, int]] = {}
        #: The compiled slots' pairs of this window (see compiled.py), read
        #: right after ``pairs``; their sites follow in ``sites``.
        self.slotted: Tensor | None = None
        self._make_slab(SLAB_START, torch.device("cpu"))
        #: Some result of this window is not in the slab: it is stacked.
        self.spilled = False
        #: A norm of this window is float64: the norms go to the float64 slab.
        self.wide_norms = False
        #: Norms accumulated in float64 (the deferred read): the squares of any
        #: float32/16 values fit, so a norm is non-finite exactly when its tensor
        #: is, and needs no check against a tensor that has moved on since.
        self.exact_norms = False
        #: A pipeline stage's micro-batch marks (``pipeline.Handoff``), or None.
        self.pipeline: Handoff | None = None

    def probe(self, t: Tensor, site: Site) -> None:
        """Launch one aminmax of ``t`` (float, non-empty) for ``site``. No sync.

        A tensor autograd records (a forward output; a gradient under
        ``create_graph``, as a gradient penalty makes) is probed with grad
        mode off: ``aminmax(out=...)`` refuses it otherwise, and a detached
        alias would be a new tensor per probe.
        """
        recorded = t.requires_grad and _grad_enabled()
        if recorded:
            _set_grad_enabled(False)
        pairs = self.pairs
        try:
            # (is_compiling first: dynamo would guard on the length read after it)
            out = None
            fits = not is_compiling() and (k := len(pairs)) < self.room and t.device == self.device
            if fits and not site.allow_neginf:
                out = self.slots[k : k + 2] if t.dtype is _FLOAT32 else self.others.take(t.dtype, k)
            if out is not None:
                _aminmax(t, out=out)
                pairs += out
            else:
                self._spill(t, site.allow_neginf)
            self.sites.append(site)
        finally:
            if recorded:
                _set_grad_enabled(True)

    def _spill(self, t: Tensor, max_only: bool) -> None:
        """Results of their own, stacked at the read: a probe no slab takes, or
        a module allow-listed to emit -inf on purpose, whose max alone is
        watched (NaN and +inf still reach it), as both figures."""
        if max_only:
            hi = _aminmax(t)[1]
            self.pairs += (hi, hi)
        else:
            self.pairs.extend(_aminmax(t))
        self.spilled = True

    def clear(self) -> None:
        if self.spilled:
            self._refit()
        self.pairs.clear()
        self.sites.clear()
        self.norms.clear()
        self.norm_sites.clear()
        if self.extras:  # (usually empty: a test is cheaper than a call)
            self.extras.clear()
        if self.spans:
            self.spans.clear()
        self.slotted = None
        if any(self.others.positions.values()):  # (float32 windows: none to clear)
            self.others.clear()
        self.wide_norms = False
        if self.pipeline is not None:
            self.pipeline.marks = []

    def _refit(self) -> None:
        """After a window that spilled: a slab where and as large as it needed."""
        self.spilled = False
        needed = len(self.pairs) + len(self.norms)
        device = self.pairs[0].device if self.pairs else self.device
        if device != self.device or len(self.slots) < needed <= SLAB_MAX:
            self._make_slab(max(len(self.slots), min(2 * needed, SLAB_MAX)), device)

    def _make_slab(self, size: int, device: torch.device) -> None:
        self.slab = torch.empty(size, device=device)
        self.slots: list[Tensor] = list(self.slab.unbind())  # its elements as 0-d views
        #: The slab's first n values as a view, by n: a window's size repeats
        #: step after step, and slicing a tensor is an op of its own (~1 µs).
        self.heads: dict[int, Tensor] = {}
        self.room = size - 1  # a probe at pairs index < room fits in the slab
        self.device = device
        self.others = OtherSlabs(size, device)

    def __len__(self) -> int:
        return len(self.sites) + len(self.norm_sites)

    def add_norms(self, tensors: list[Tensor], sites: list[Site]) -> None:
        """One ``_foreach_norm`` launch over ``tensors`` (floating, dense).

        With grad mode off: the optimizer's hooks run outside its ``no_grad``,
        and parameters, like the gradients ``backward(create_graph=True)``
        leaves, are tensors autograd would record (a norm recorded as a graph
        node cannot be copied into the slab).
        """
        if tensors:
            recorded = _grad_enabled()  # (a switch, not a no_grad() context: no frames)
            if recorded:
                _set_grad_enabled(False)
            try:
                # (looked up on torch each time: tests count the launches by patching it)
                if self.exact_norms:
                    norms = torch._foreach_norm(tensors, 2, dtype=_FLOAT64)
                else:
                    norms = torch._foreach_norm(tensors)
            finally:
                if recorded:
                    _set_grad_enabled(True)
            if not self.wide_norms and _FLOAT64 in map(_DTYPE, norms):  # (a C loop)
                self.wide_norms = True  # (the float32 slab would round them)
            self.norms.extend(norms)
            self.norm_sites.extend(sites)

    def gather(self) -> Tensor | None:
        """All results as one 1-d tensor: pairs, then norms, then extras."""
        n, m = len(self.pairs), len(self.norms) + len(self.extras)
        slotted = self.slotted
        if not self.spilled and slotted is None and n + m <= len(self.slots):
            return self._from_slabs(n, m)
        if slotted is None:
            everything = self.pairs + self.norms + self.extras
            # One launch; mixed dtypes promote, NaN and inf survive the promotion.
            return torch.stack(everything) if everything else None
        rest = self.norms + self.extras
        parts = [torch.stack(self.pairs)] if self.pairs else []
        parts += [slotted, torch.stack(rest)] if rest else [slotted]
        return torch.cat(parts)

    def _from_slabs(self, n: int, m: int) -> Tensor | None:
        """The window's ``n`` pair values, then its ``m`` norms and extras (the
        extras, 0-d: a loss, a scale, copied with the norms, not stacked
        apart: two ops fewer a step), read from the slabs in place."""
        if m:  # float32 holds float16/bfloat16 values exactly, float64 ones go wide
            values = self.norms
            if self.extras:
                values = values + self.extras
                if not self.wide_norms and _FLOAT64 in map(_DTYPE, self.extras):
                    self.wide_norms = True  # (DDP's local norm, a float64 loss: exact)
            slots = self.others.slots(_FLOAT64) if self.wide_norms else self.slots
            torch._foreach_copy_(slots[n : n + m], values)
        if not n + m:
            return None
        main = self.heads.get(n + m)
        if main is None:
            main = self.heads[n + m] = self.slab[: n + m]
        if self.wide_norms or any(self.others.positions.values()):
            return self.others.combine(main, n, self.wide_norms)
        return main


def local(t: Tensor) -> Tensor:
    """This rank's part of a tensor: the local shard of an FSDP2 ``DTensor``.

    Each rank checks what it holds; a shard made non-finite on one rank is that
    rank's finding, and the others receive it through the next all-gather.
    """
    inner = getattr(t, "_local_tensor", None)  # DTensor's own shard, outside autograd
    if isinstance(inner, Tensor):
        return inner
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    with torch.no_grad():
        shard: Tensor = to_local().detach()
    return shard


def tensors_of(value: Any) -> Iterable[tuple[str, Tensor]]:
    """:func:`iter_tensors`, without a generator to run for a lone tensor (most outputs)."""
    return (("", value),) if isinstance(value, Tensor) else iter_tensors(value)


def iter_tensors(value: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, Tensor]]:
    """(path, tensor) for every tensor in a nested output or input structure.

    Handles tensors, tuples/lists, dicts (and ``ModelOutput``, a dict subclass)
    and dataclasses; other objects are ignored. Depth is bounded so a
    self-referencing structure cannot hang the training loop.
    """
    if isinstance(value, Tensor):
        yield path, value
    elif depth > 4:
        return
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from iter_tensors(item, f"{path}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from iter_tensors(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            item = getattr(value, f.name, None)
            yield from iter_tensors(item, f"{path}.{f.name}" if path else f.name, depth + 1)
