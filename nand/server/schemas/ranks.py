"""Ranks: one rank's status, a page of them, and their heartbeat series."""

from __future__ import annotations

from pydantic import BaseModel, Field

# The vocabulary is the event model's, written once (nand/events.py):
# RankState ``finished`` is a bye after a normal exit (or a requested stop),
# ``crashed`` a bye with an exception (e.g. gloo's "Connection reset by peer"
# after a peer died). Relation of a rank's first non-finite value to the run's
# origin: ``origin``, ``simultaneous`` (several ranks at the same logical
# point, none first: no rank is then ``origin``), ``received`` (through a
# collective), ``produced`` (made it itself, after the origin), or null.
from nand.events import RankState, Relation
from nand.server.schemas.events import EventOut


class RankStatus(BaseModel):
    rank: int
    host: str
    pid: int
    state: RankState
    step: int
    last_seen: float
    steps_per_s: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    max_activation: float | None = None
    amp_skipped: int = 0
    first_event: EventOut | None = None
    relation: Relation | None = None
    #: Whether this rank sent a flight-recorder window (``/flight?rank=`` has one).
    has_flight: bool = False
    #: The device its parameters live on ("cpu", "cuda:0"), from its hello.
    device: str = ""
    #: Why it left: "closed", "exit", "exception: RuntimeError"... ("" while running).
    bye_reason: str = ""
    #: Messages its agents dropped before the server had them (their latest
    #: cumulative counts), and why: ``{reason: n}``, largest first.
    messages_dropped: int = 0
    dropped: dict[str, int] = Field(default_factory=dict)


class RankPage(BaseModel):
    """One page of a run's ranks in rank order, with counts over all of them.

    The next page is ``?after=<next_after>``; ``next_after`` is null on the last.
    """

    items: list[RankStatus]
    #: Ranks that have reported, in all.
    total: int
    limit: int
    #: The ``after`` that asks for the next page; null when this is the last one.
    next_after: int | None = None
    #: Every rank's state, counted (only states some rank is in).
    states: dict[RankState, int] = Field(default_factory=dict)


class SeriesPoint(BaseModel):
    time: float
    step: int
    loss: float | None = None
    grad_norm: float | None = None
    steps_per_s: float | None = None
    max_activation: float | None = None


class RankSeries(BaseModel):
    rank: int
    points: list[SeriesPoint]
