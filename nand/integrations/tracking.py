"""What the tracker bridges (``nand.integrations.wandb``, ``.tensorboard``) write.

Both are ``on_event`` callables (``nand.agent.output.hook``): they get a
:class:`nand.Event` for each incident and a :class:`nand.Alert` for each
early warning of the rank they run on, and say it in the tracker's terms.
This module holds what they share: the words, and the run's state as the
tracker shows it (``nand/state``: ``warning`` after a first warning,
``diverged`` after a first incident; ``nand/origin`` and ``nand/step`` say
where and when that state began, and a later report does not move them).

They run where the tracker's run is, usually rank 0, and say what that rank
saw: a rank that *received* a NaN says so (``cause``); which rank produced it
is the nand server's verdict.
"""

from __future__ import annotations

from typing import Any

from nand.agent.output.hook import Report
from nand.events import Event

#: The tracker's word for each state; worse ones later.
STATES = ("warning", "diverged")


def is_incident(report: Report) -> bool:
    return isinstance(report, Event)


def kind(report: Report) -> str:
    """``incident`` or ``warning``: the tag under ``nand/`` it is written to."""
    return "incident" if is_incident(report) else "warning"


def where(report: Report) -> str:
    """Where it was seen, in a few words: ``h.0.mlp.c_fc (forward) on rank 0``."""
    if isinstance(report, Event):
        return f"{report.module or '<root>'} ({report.phase}) on rank {report.rank}"
    place = f"{report.kind} in {report.module}" if report.module else report.kind
    return f"{place} on rank {report.rank}"


def title(report: Report) -> str:
    """A short headline (a W&B alert's title: alerts with one title are throttled together)."""
    if isinstance(report, Event):
        return f"nand: non-finite values in run {report.run}"
    return f"nand: early warning ({report.kind})"


def text(report: Report) -> str:
    """The sentence nand logs, and the step."""
    if isinstance(report, Event):
        said = report.message or report.describe()
        return f"{said} (cause: {report.cause}; step {report.step})"
    return f"rank {report.rank}: {report.message or report.kind} (step {report.step})"


class TrackerState:
    """The run's state as one tracker was told it: moves only to worse."""

    def __init__(self) -> None:
        self.state: str | None = None

    def summary(self, report: Report) -> dict[str, Any] | None:
        """``nand/state``, ``nand/origin``, ``nand/step`` when this report
        makes the state worse (the first warning, the first incident), else None."""
        new = "diverged" if is_incident(report) else "warning"
        if self.state is not None and STATES.index(new) <= STATES.index(self.state):
            return None
        self.state = new
        return {"nand/state": new, "nand/origin": where(report), "nand/step": report.step}
