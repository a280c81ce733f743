"""The once-per-step look at the probe results, and the slow path.

Every optimizer step the boundary (``boundary.Boundary.check``) keeps the
values read from the device in one go as a :class:`StepRow` and sums them to
see whether anything is non-finite; :func:`near_limit` looks for overflow
headroom, and :func:`telemetry` turns a row into per-module max|x| of
activations and gradients and the gradient norm when someone asks.

:func:`first_finding` runs only when something was non-finite. It replays the
buffer in execution order, labels every entry with its micro-step, call index
and order, and picks the logically first one, ``(micro_step, phase, order)``:

- ``input``: the root's input data (cause ``data``);
- ``forward``: the first non-finite output, or inline value of a parent;
- ``loss``: the gradient arriving at the root output, forward being finite;
- ``backward``: tensor hooks fire in backward order. The first non-finite
  gradient sits on the output of the module that *fed* the culprit; the
  culprit is the site whose gradient fired just before it (finite), i.e. the
  module whose backward turned a finite gradient into a non-finite one;
- ``grad`` / ``param`` / ``optimizer_state``: multi-tensor 2-norms. A 2-norm of
  finite values can overflow, so these are verified with ``isfinite`` on the
  tensor itself before anything is reported.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
from torch import Tensor

from nand.agent.detect.probes import Site, local
from nand.agent.detect.sampling import SAMPLE
from nand.agent.step.finding import Finding, Probed
from nand.agent.step.handoff import entries, handed_over
from nand.events import PHASE_RANK, Cause, Phase

#: Kinds of forward sites whose max|x| is a layer's telemetry ("sample": the
#: light mode's rotating sample, ``detect/sampling.py``; never a finding).
_ACT_KINDS = frozenset({"output", "inline", SAMPLE})

#: Below this max|x| no activation can be near any float dtype's limit (fp16:
#: 65504), so the per-site headroom check is skipped.
HEADROOM_FRACTION = 0.5
HEADROOM_FLOOR = HEADROOM_FRACTION * 65504.0


@dataclasses.dataclass(slots=True, kw_only=True)
class StepRow:
    """One step's raw figures, as read; the flight recorder keeps these.

    Turning them into per-module telemetry (:func:`telemetry`) happens only
    when someone looks (an incident, a heartbeat, a flight request), so a
    healthy step costs a sum, a min and a max over a short list of floats.
    """

    step: int
    values: list[float]
    sites: list[Site | None]
    norm_sites: list[Site]
    scale: float = 1.0  # AMP scale of the tensor-hook gradients
    norm_scale: float = 1.0  # AMP scale still in the .grad norms
    loss: float | None = None


@dataclasses.dataclass(slots=True, kw_only=True)
class Telemetry:
    act: list[float | None]  # per module index: max |activation|
    grad: list[float | None]  # per module index: max |gradient out of it|, unscaled
    grad_norm: float | None
    max_act: float | None


def near_limit(row: StepRow, n_pair_values: int) -> tuple[Site, float] | None:
    """The first forward site whose max|x| exceeds half its dtype's largest value.

    ``n_pair_values``: how many of ``row.values`` are (min, max) pairs.
    """
    pairs = row.values[:n_pair_values]
    # Fast exit for the healthy common case (NaN makes max/min unreliable, but
    # then the detailed loop below runs, which skips non-finite figures).
    if not pairs or max(max(pairs), -min(pairs)) < HEADROOM_FLOOR:
        return None
    for site, m in _site_maxima(row):
        dtype = site.dtype
        if site.phase != "forward" or dtype is None or not math.isfinite(m):
            continue
        if m > HEADROOM_FRACTION * torch.finfo(dtype).max:
            return site, m
    return None


def _site_maxima(row: StepRow) -> list[tuple[Site, float]]:
    out = []
    i = 0
    for site in row.sites:
        if site is None:
            continue
        lo, hi = row.values[i], row.values[i + 1]
        i += 2
        out.append((site, (hi if hi > -lo else -lo) + 0.0))  # + 0.0: no "-0"
    return out


def telemetry(row: StepRow, n_modules: int) -> Telemetry:
    """Per-module max|x| of activations and (unscaled) gradients, grad norm."""
    act: list[float | None] = [None] * n_modules
    grad: list[float | None] = [None] * n_modules
    for site, m in _site_maxima(row):
        if site.kind not in _ACT_KINDS or site.index < 0:
            continue
        target = act if site.phase == "forward" else grad
        if site.phase != "forward":
            m /= row.scale
        old = target[site.index]
        if old is None or m > old:
            target[site.index] = m
    start = 2 * (len(row.sites) - row.sites.count(None))
    norms = row.values[start : start + len(row.norm_sites)]
    squares = [n * n for n, s in zip(norms, row.norm_sites, strict=False) if s.phase == "grad"]
    grad_norm = math.sqrt(sum(squares)) / row.norm_scale if squares else None
    max_act = max((a for a in act if a is not None), default=None)
    return Telemetry(act=act, grad=grad, grad_norm=grad_norm, max_act=max_act)


#: Said of a float64 tensor's norm finding read one step late: not verified.
LAGGED_NOTE = (
    "read one step late: its 2-norm was non-finite, not re-checked element by element "
    "(the tensor has changed since; the 2-norm of a float64 tensor above ~1e154 overflows)"
)


def first_finding(
    buf: Probed,
    values: list[float],
    grad_cause: Cause = "produced",
    prev_micro: int = 0,
    micro_base: int = 0,
    lagged: bool = False,
) -> Finding | None:
    """The logically first verified non-finite entry, or None (a false alarm).

    ``prev_micro`` labels param/optimizer_state entries, which were taken after
    the previous optimizer step and read with this one. ``grad_cause`` is the
    cause of a non-finite ``.grad`` (``received`` when it came through an
    all-reduce; the boundary measures it, see ``locate.grad_cause``).
    ``micro_base`` is the micro-step the window's first root call is.
    ``lagged``: the window was read one step late, when its gradients and
    parameters have been updated or zeroed since; its norms were accumulated
    in float64 (``ProbeBuffer.exact_norms``), non-finite exactly when their
    float32/16 tensor is. A non-finite norm is then a finding as read (its
    event carries the norm, no counts); of a float64 tensor, one marked
    unverified (:data:`LAGGED_NOTE`).
    """
    norms = _norm_findings(buf, values, grad_cause, prev_micro, lagged)
    candidates = _activation_findings(buf, values, micro_base) + norms
    for finding in sorted(candidates, key=_logical_key):
        if finding.tensor is None or not bool(torch.isfinite(finding.tensor).all()):
            return handed_over(finding, buf.pipeline)  # (a pipeline stage's neighbours')
    return None


def _logical_key(f: Finding) -> tuple[int, int, int, int]:
    # param/optimizer_state entries come from the previous step: they go first.
    previous = 0 if f.phase in ("param", "optimizer_state") else 1
    return (previous, f.micro, PHASE_RANK[f.phase], f.order)


def _activation_findings(buf: Probed, values: list[float], micro_base: int) -> list[Finding]:
    found: list[Finding] = []
    orders: dict[tuple[int, str], int] = {}
    prev_backward: dict[int, Site] = {}  # micro -> last finite backward site
    first_bad_backward: set[int] = set()
    bad_forward: set[int] = set()  # micro-steps with a non-finite forward so far
    for micro, site, lo, hi, call in entries(buf, values, micro_base):
        if site.kind == SAMPLE:
            continue  # telemetry only: the light mode's checks and its replay find
        key = (micro, site.phase)
        order = orders.get(key, 0)
        orders[key] = order + 1
        finite = math.isfinite(lo) and math.isfinite(hi)
        if site.kind == "loss" and finite:
            prev_backward[micro] = site  # the root's own backward runs next
            continue
        if site.phase == "backward":
            if finite:
                prev_backward[micro] = site
                continue
            if micro in first_bad_backward:
                continue
            first_bad_backward.add(micro)
            found.append(_backward_finding(site, prev_backward.get(micro), micro, order, lo, hi))
        elif not finite:
            if site.phase == "input" and micro in bad_forward:
                # An entry point's input (detect/entry.py) after a module of
                # this micro-step made something non-finite: carried from
                # there, not data; that module's finding is first.
                continue
            if site.phase == "forward":
                bad_forward.add(micro)
            cause: Cause = "data" if site.phase == "input" else "produced"
            module = "" if site.phase == "loss" else site.module
            found.append(
                Finding(
                    site=site,
                    phase=site.phase,
                    module=module,
                    module_type=site.module_type,
                    micro=micro,
                    order=order,
                    call=call,
                    lo=lo,
                    hi=hi,
                    cause=cause,
                )
            )
    return found


def _backward_finding(
    site: Site, before: Site | None, micro: int, order: int, lo: float, hi: float
) -> Finding:
    """A non-finite gradient: blamed on the module whose backward ran just before."""
    phase: Phase = "loss" if before is None else "backward"  # (none: the loss gradient)
    owner = site if before is None else before
    return Finding(
        site=site,
        phase=phase,
        module=owner.module if before is not None else "",
        module_type=owner.module_type,
        micro=micro,
        order=order,
        lo=lo,
        hi=hi,
        cause="produced",
    )


def _norm_findings(
    buf: Probed, values: list[float], grad_cause: Cause, prev_micro: int, lagged: bool
) -> list[Finding]:
    start = 2 * (len(buf.sites) - buf.sites.count(None))
    last_micro = max(buf.sites.count(None) - 1, 0)
    found: list[Finding] = []
    orders: dict[str, int] = {}
    for site, norm in zip(buf.norm_sites, values[start:], strict=False):
        order = orders.get(site.phase, 0)
        orders[site.phase] = order + 1
        if math.isfinite(norm):
            continue
        tensor = site.param.grad if site.phase == "grad" and site.param is not None else site.param
        if tensor is None and not lagged:
            continue
        micro = last_micro if site.phase == "grad" else prev_micro
        cause = grad_cause if site.phase == "grad" else "produced"
        found.append(
            Finding(
                site=site,
                phase=site.phase,
                module=site.module,
                module_type=site.module_type,
                micro=micro,
                order=order,
                lo=norm,
                hi=norm,
                cause=cause,
            )
        )
        if lagged:
            if site.param is None or site.param.dtype is torch.float64:
                found[-1].note = LAGGED_NOTE
        elif tensor is not None:
            found[-1].tensor = local(tensor)
    return found


#: Said of every event found from slots (see compiled.py).
COMPILED_NOTE = (
    "under torch.compile: checked at module outputs (forward) and parameter gradients "
    "(backward); micro-steps and repeated calls are folded"
)


def gradient_frontier(
    buf: Probed, values: list[float], first: Finding, verify: bool = True
) -> Finding:
    """Where backward went non-finite, judged from parameter gradients alone.

    Under torch.compile no gradient inside a graph is probed (see
    compiled.py); the parameters' gradients are. A gradient made non-finite
    in some module's backward reaches every parameter upstream of it and none
    downstream, so in forward order the modules whose parameters got a
    non-finite gradient come first and those that stayed finite after. The
    culprit lies between the last of the first kind and the first of the
    second: that module is named, as eager mode names the module whose
    gradient fired just before the first non-finite one; the note names both.
    With none finite after it, the gradient came in non-finite from the loss.
    ``first`` is the logically first finding, a ``grad`` one made on this rank.
    ``verify``: check a non-finite norm against the gradient (not when the
    window was read one step late and the gradient is gone).
    """
    bad, good = _owners_by_gradient(buf, values, verify)
    order = _forward_sites(buf)
    last_bad = max((i for i, site in enumerate(order) if site.module in bad), default=None)
    if last_bad is None:
        first.note = COMPILED_NOTE
        return first
    after = next((site for site in order[last_bad + 1 :] if site.module in good), None)
    upstream = order[last_bad].module or "<root>"
    if after is None:
        note = f"{COMPILED_NOTE}; every parameter up to {upstream} got a non-finite gradient"
        return dataclasses.replace(
            first, site=order[-1], phase="loss", module="", note=note, tensor=None
        )
    note = (
        f"{COMPILED_NOTE}; made between {upstream}, the last module in forward order whose "
        f"parameters got a non-finite gradient, and {after.module}, the first after it whose "
        "parameters' gradients stayed finite"
    )
    return dataclasses.replace(
        first,
        site=after,
        phase="backward",
        module=after.module,
        module_type=after.module_type,
        note=note,
        tensor=None,
    )


def _owners_by_gradient(
    buf: Probed, values: list[float], verify: bool
) -> tuple[set[str], set[str]]:
    """Modules owning a parameter whose gradient is non-finite, and the rest."""
    start = 2 * (len(buf.sites) - buf.sites.count(None))
    bad: set[str] = set()
    owners: set[str] = set()
    for site, norm in zip(buf.norm_sites, values[start:], strict=False):
        if site.phase != "grad":
            continue
        owner = site.module.rpartition(".")[0]
        owners.add(owner)
        grad = site.param.grad if site.param is not None else None
        if math.isfinite(norm) or (verify and grad is None):
            continue
        # (a 2-norm of finite values overflows: verified where the gradient is still there)
        if not verify or grad is None or not bool(torch.isfinite(local(grad)).all()):
            bad.add(owner)
    return bad, owners - bad


def _forward_sites(buf: Probed) -> list[Site]:
    """The first forward site of each module probed this window, in first-run order."""
    seen: dict[str, Site] = {}
    for site in buf.sites:
        if site is not None and site.phase == "forward":
            seen.setdefault(site.module, site)
    return list(seen.values())


class ParamSource(Protocol):
    """The parameters the optimizer hooks know (``optimizer.OptimizerHooks``)."""

    def params_behind(self, module: str) -> list[Tensor]: ...

    def param_site(self, p: Tensor) -> Site: ...


def param_behind(finding: Finding, micro: int, source: ParamSource) -> Finding | None:
    """A forward finding at a module whose own parameter (the root: any) is non-finite.

    The slow path, for a parameter nobody read because it was implied
    finite: something other than the optimizer wrote it (a checkpoint, user
    code). Reported as that parameter, like a parameter read bad.
    """
    for p in source.params_behind(finding.module):
        if not bool(torch.isfinite(local(p)).all()):
            return param_finding(source.param_site(p), p, micro)
    return None


def param_finding(site: Site, p: Tensor, micro: int, note: str = "") -> Finding:
    """Parameter ``p`` (at ``site``) found non-finite, made on this rank."""
    return Finding(
        site=site,
        phase="param",
        module=site.module,
        module_type=site.module_type,
        micro=micro,
        order=0,
        lo=math.nan,
        hi=math.nan,
        cause="produced",
        tensor=local(p),
        note=note,
    )
