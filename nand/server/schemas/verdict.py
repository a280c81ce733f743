"""The verdict: the one body a scheduler polls, with the failures, stop and replicas it names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from nand.events import RunState
from nand.server.schemas.events import Origin
from nand.server.schemas.warnings import WarningsSummary

#: How a run failed, on one or more ranks (``nand.server.analysis.failures``).
FailureState = Literal["diverged", "lost", "crashed", "stalled"]


class StopInfo(BaseModel):
    #: Every rank stops at this step or the next step boundary after it.
    step: int
    requested_at: float
    reason: str = ""
    #: The step at which the ranks stopped (from their byes), once they did.
    stopped_at: int | None = None


class ReplicaCheck(BaseModel):
    """What the replicas' fingerprints say (``nand.server.analysis.replicas``)."""

    #: ``consistent``: every rank agreed at ``last_good_step``; ``mismatch``:
    #: ``ranks`` differed from the others at ``first_bad_step``.
    state: Literal["consistent", "mismatch"]
    ranks: list[int] = Field(default_factory=list)
    first_bad_step: int | None = None
    last_good_step: int | None = None
    params: list[str] = Field(default_factory=list)
    summary: str = ""


class FailureOut(BaseModel):
    """One way a run failed, on one or more ranks together (``nand.server.analysis.failures``)."""

    #: ``diverged`` (went non-finite), ``lost`` (silent without a bye),
    #: ``crashed`` (left with an exception) or ``stalled`` (no step progress).
    state: FailureState
    ranks: list[int]
    #: When it happened (the first of ``ranks``), Unix seconds: the server's
    #: last message from a lost rank, a crashed rank's bye, a stalled rank's
    #: missed step, the non-finite origin's event.
    at: float
    step: int
    #: ``crashed``: the exception's type as the agent named it, else "".
    exception: str = ""


class Verdict(BaseModel):
    """The one call a scheduler polls: is this run healthy, and if not, where from."""

    run: str
    #: Which attempt of the run this is (see RunSummary.attempt).
    attempt: int = 1
    #: The agents' launch identity (``NAND_LAUNCH``), null when they sent none.
    launch: str | None = None
    #: False for an earlier attempt read with ``?attempt=``: its state is history.
    live: bool = True
    state: RunState
    origin: Origin | None = None
    #: Ranks that went non-finite, in rank order.
    ranks_affected: list[int] = Field(default_factory=list)
    #: Ranks whose first non-finite value arrived through a collective.
    ranks_received: list[int] = Field(default_factory=list)
    #: True when several ranks went non-finite at the origin's logical point.
    simultaneous: bool = False
    #: Cause hint: ``input_data``, ``loss``, ``overflow``, ``gradient_explosion``,
    #: ``optimizer_update``, ``produced_in_layer`` or ``""``.
    hint: str = ""
    #: One paragraph a person can read at a glance.
    summary: str = ""
    #: Every failure in the order it happened: the first is where the run went
    #: wrong (its ``state`` is the run's), the others its consequences.
    failures: list[FailureOut] = Field(default_factory=list)
    #: When the run went non-finite (origin's wall clock), else null.
    since: float | None = None
    stop: StopInfo | None = None
    #: Whether a stop can still reach a rank (false once every rank has exited).
    stoppable: bool = True
    #: Messages the agents dropped before the server had them (see RunSummary).
    messages_dropped: int = 0
    dropped: dict[str, int] = Field(default_factory=dict)
    #: The ranks that dropped any: the server's record of them has gaps.
    ranks_with_gaps: list[int] = Field(default_factory=list)
    #: The gaps in one sentence ("Rank 3 dropped 1,204 messages before the
    #: server had them (spool_full 1,000, rejected 204): …"); "" without any.
    gaps_summary: str = ""
    #: The DDP replicas compared (null: no fingerprints received yet).
    replica: ReplicaCheck | None = None
    #: Early warnings (loss spikes, growing gradients, headroom; a rank whose
    #: own gradients stand out from the others').
    warnings: WarningsSummary = Field(default_factory=WarningsSummary)
