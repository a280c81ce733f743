"""Turns a :class:`~nand.agent.step.analysis.Finding` into an :class:`~nand.events.Event`.

This is the slow path: it runs once per incident, so it may look at tensors
(counting NaN/+inf/-inf on a parameter, gradient or optimizer state) and sync.
Activations are gone by the step boundary; their events carry the aminmax
figures that were read (min/max, NaN-propagating), shape and dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nand.agent.identity import Identity
from nand.agent.step.finding import Finding
from nand.events import VIA_GRAD_ALL_REDUCE, Event


def build_event(
    finding: Finding, who: Identity, step: int, seq: int, scale: float, root_type: str
) -> Event:
    event = Event(
        run=who.run,
        rank=who.rank,
        world_size=who.world_size,
        host=who.host,
        pid=who.pid,
        step=step,
        micro_step=finding.micro,
        phase=finding.phase,
        module=finding.module,
        module_type=finding.module_type if finding.module else root_type,
        order=finding.order,
        cause=finding.cause,
        via=received_via(finding),
        call=finding.call,
        seq=seq,
    )
    if finding.tensor is not None:
        _count(event, finding.tensor)
    else:
        _from_minmax(event, finding, scale)
    event.message = describe(event, finding)
    return event


def received_via(finding: Finding) -> str:
    """The collective a received value came through: the one its finding
    names, else for a gradient the wrapper's gradient reduction."""
    if finding.cause != "received":
        return ""
    return finding.via or (VIA_GRAD_ALL_REDUCE if finding.phase == "grad" else "")


def _count(event: Event, t: Tensor) -> None:
    t = t.detach()
    event.nan = int(torch.isnan(t).sum())
    event.posinf = int((t == math.inf).sum())
    event.neginf = int((t == -math.inf).sum())
    finite = t[torch.isfinite(t)].float()
    if finite.numel():
        event.min, event.max = float(finite.min()), float(finite.max())
        event.max_abs = float(finite.abs().max())
    event.shape, event.dtype = list(t.shape), str(t.dtype).removeprefix("torch.")


def _from_minmax(event: Event, finding: Finding, scale: float) -> None:
    # Gradients under AMP are scaled: report what the user would compute.
    div = scale if finding.phase in ("backward", "loss") else 1.0
    event.min, event.max = finding.lo / div, finding.hi / div
    site = finding.site.forward or finding.site  # a gradient has its value's shape
    event.shape = list(site.shape or ())
    event.dtype = str(site.dtype).removeprefix("torch.") if site.dtype is not None else ""


def describe(event: Event, finding: Finding) -> str:
    """The one log line of an incident: who, where, what, and what it means."""
    text = event.describe(shape="shape not recorded" if finding.site.shape is None else None)
    extra = []
    if finding.site.kind == "inline" and finding.phase == "forward":
        extra.append(f"made by code inline in the forward of {event.module or '<root>'}")
    if finding.site.kind == "input":
        extra.append(f"input argument {finding.site.slot}")
    if finding.phase == "backward" and not finding.note:
        extra.append("its backward turned a finite gradient non-finite")
    if finding.phase == "loss":
        extra.append("the forward was finite: look at the loss computation")
    if finding.call:
        extra.append(f"call {finding.call + 1} of this module in the micro-step")
    if event.max_abs is not None and event.nan is not None:
        extra.append(f"largest finite |x| {event.max_abs:.3g}")
    if finding.note:
        extra.append(finding.note)
    return text + ("; " + "; ".join(extra) if extra else "")
