"""The light mode's replay: the event the full mode would have given.

In ``mode="light"`` (``nand.agent.detect.tiers``) a step's checks say that
something went non-finite (the root's output, the loss, a gradient), not
which module made it. The micro-step is replayed with every module hooked
(``Tiers.probed``); the replay's probes are read and analysed as a step's
window is (``step.analysis.first_finding``), and the first finding takes
the place of the light event's where, phase and cause
(:func:`make_exact`). Its step and sequence number stay, except where the
module the replay names has a non-finite parameter of its own: then, as in
the full mode (``analysis.param_behind``), the event is that parameter's,
written after the last update and labelled with the step before.

A gradient seen in light mode is the sum of every micro-step's: the
micro-steps held are replayed in order, and the first that makes a
non-finite value is the one named.
"""

from __future__ import annotations

from nand.agent.detect.probes import ProbeBuffer
from nand.agent.step.analysis import first_finding, param_behind
from nand.agent.step.boundary import Boundary
from nand.agent.step.finding import Finding
from nand.agent.step.report import build_event
from nand.events import Event

#: Phases whose light event is not where the value was made: a replay names it.
NEEDS_PROBES = ("forward", "backward", "grad")
#: The event's fields a replay's finding decides (the rest: who, when, replay).
EXACT_FIELDS = (
    "micro_step",
    "phase",
    "module",
    "module_type",
    "order",
    "cause",
    "call",
    "nan",
    "posinf",
    "neginf",
    "min",
    "max",
    "max_abs",
    "shape",
    "dtype",
    "message",
)


def needs_probes(event: Event, external: bool) -> bool:
    """Whether a light event needs the probed replay to be exact: not the
    data, the loss, the update's values, nor a received value (the same
    event as the full mode's). A loss, or a gradient that reached the
    model's output, a second time in a micro-step (``call`` > 0: a gradient
    penalty's) went through the modules' backward first, unprobed; and
    where a framework's step runs the model (``external``: micro-steps
    marked by ``new_batch``, Lightning's ``training_step`` calling the
    model's parts), no root output was checked before the loss: the
    forward may have made it."""
    if event.phase == "loss":
        return event.call > 0 or external
    return event.phase in NEEDS_PROBES and event.cause != "received"


def before_the_loss(finding: Finding | None) -> Finding | None:
    """Of a loss event's probed replay, ``finding`` where it is what the
    loss carried on (the input, a module's forward output; the backward of
    a second-call loss event replays a backward that ran before it), not
    the loss itself (a 0-d output of the root: a model given ``labels=``)
    nor the gradient the loss sent back."""
    if finding is None or finding.phase == "loss":
        return None
    site = finding.site
    if finding.phase == "forward" and not finding.module and site.shape == ():
        return None
    return finding


def probed_finding(buf: ProbeBuffer, micro: int) -> Finding | None:
    """The first non-finite value the replay of micro-step ``micro`` probed."""
    gathered = buf.gather()
    if gathered is None:
        return None
    return first_finding(buf, gathered.tolist(), micro_base=micro)


def make_exact(event: Event, finding: Finding, boundary: Boundary, before: int) -> None:
    """Give ``event`` the where, phase and cause of the replay's ``finding``;
    ``before``: the micro-steps of the step before (a parameter's label)."""
    if finding.phase == "forward" and boundary.params is not None:
        finding = param_behind(finding, max(before - 1, 0), boundary.params) or finding
    if finding.phase == "param":  # (the full mode's label: the update before this step)
        event.step -= 1
    scale = boundary.row.scale if boundary.row is not None else 1.0
    exact = build_event(finding, boundary.who, event.step, event.seq, scale, boundary.root_type)
    for name in EXACT_FIELDS:
        setattr(event, name, getattr(exact, name))
