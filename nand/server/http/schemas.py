"""The REST API's response and request bodies: the contract the dashboard and
schedulers rely on. Separate from the database tables (``models.py``).

Floats that were NaN/inf on the wire are ``null`` here (JSON has no NaN);
counts (``nan``, ``posinf``, ``neginf``) say what the values were.
Times are Unix seconds (float, UTC).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# The vocabulary is the event model's, written once (nand/events.py):
# RankState ``finished`` is a bye after a normal exit (or a requested stop),
# ``crashed`` a bye with an exception (e.g. gloo's "Connection reset by peer"
# after a peer died). Relation of a rank's first non-finite value to the run's
# origin: ``origin``, ``simultaneous`` (several ranks at the same logical
# point, none first: no rank is then ``origin``), ``received`` (through a
# collective), ``produced`` (made it itself, after the origin), or null.
from nand.events import Cause, Phase, RankState, Relation, RunState, WarningKind
from nand.server.analysis.failures import FailureState


class EventOut(BaseModel):
    id: int
    run: str
    rank: int
    world_size: int
    host: str
    pid: int
    step: int
    micro_step: int
    phase: Phase
    module: str
    module_type: str
    order: int
    cause: Cause
    via: str = ""  # a received value: the collective it came through (Event.via)
    call: int = 0
    nan: int | None = None
    posinf: int | None = None
    neginf: int | None = None
    min: float | None = None
    max: float | None = None
    max_abs: float | None = None
    #: What the values were, in words: "NaN", "+inf x3", "NaN and -inf"...
    values: str = ""
    shape: list[int] = Field(default_factory=list)
    dtype: str = ""
    time: float
    seq: int
    message: str = ""
    #: The replay of the step: the aten op that made the value, the user's
    #: line (path:line), whether the replay made it again (null: not
    #: replayed), and what was replayed or why not.
    op: str = ""
    source: str = ""
    reproduced: bool | None = None
    replay: str = ""


class EventPage(BaseModel):
    items: list[EventOut]
    total: int
    offset: int
    limit: int


class Origin(BaseModel):
    """Where the run first went non-finite."""

    #: The rank that was first; null when several went non-finite at the same
    #: point (``simultaneous``) and none was first.
    rank: int | None
    #: The ranks where it started: ``[rank]``, or every simultaneous rank.
    ranks: list[int] = Field(default_factory=list)
    host: str = ""
    step: int
    micro_step: int
    phase: Phase
    module: str
    module_type: str
    cause: Cause
    dtype: str = ""
    shape: list[int] = Field(default_factory=list)
    nan: int | None = None
    posinf: int | None = None
    neginf: int | None = None
    max_abs: float | None = None
    #: What the values were, in words (see EventOut.values).
    values: str = ""
    #: The replay's op, line and answer (see EventOut).
    op: str = ""
    source: str = ""
    reproduced: bool | None = None
    time: float
    event_id: int


class StopInfo(BaseModel):
    #: Every rank stops at this step or the next step boundary after it.
    step: int
    requested_at: float
    reason: str = ""
    #: The step at which the ranks stopped (from their byes), once they did.
    stopped_at: int | None = None


class WarningOut(BaseModel):
    """An early warning from one rank (``nand.events.Alert``): still finite."""

    rank: int
    step: int
    kind: WarningKind
    module: str = ""
    value: float | None = None
    reference: float | None = None
    message: str = ""
    time: float = 0.0


class WarningsSummary(BaseModel):
    """A run's early warnings: how many, by kind, and the first (by step)."""

    count: int = 0
    by_kind: dict[str, int] = Field(default_factory=dict)
    first: WarningOut | None = None


class GpuTally(BaseModel):
    """One GPU of a host across runs (see ``nand.server.analysis.hosts``)."""

    gpu: int = 0
    runs: int = 0
    ranks: int = 0
    #: Runs whose lone origin of a non-finite value ran here.
    incidents: int = 0
    #: Runs in which a rank here held parameters unlike the other replicas'.
    mismatches: int = 0
    #: Ranks here that exited with an exception.
    crashes: int = 0
    last_seen: float = 0.0


class HostTally(GpuTally):
    """One host across runs; ``gpu`` is unused (0), ``gpus`` breaks it down."""

    host: str
    gpus: list[GpuTally] = Field(default_factory=list)


class HostPage(BaseModel):
    """Hosts, worst first; ``runs``: how many recent runs were looked at."""

    items: list[HostTally]
    total: int
    runs: int


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


class RunSummary(BaseModel):
    run: str
    #: 1, 2, ...: a run id used again (a re-applied Job) is a new attempt; this
    #: is the live (latest) one unless ``?attempt=`` asked for another.
    attempt: int = 1
    #: The agents' launch identity (``NAND_LAUNCH``), null when they sent none.
    launch: str | None = None
    #: False for an earlier attempt, superseded by a newer one.
    live: bool = True
    state: RunState
    world_size: int
    ranks_seen: int
    latest_step: int
    started_at: float
    last_seen: float
    event_count: int
    #: Early warnings stored (a loss spike, a growing gradient norm, headroom,
    #: a rank whose own gradients stand out).
    warnings: int = 0
    origin: Origin | None = None
    #: Messages the agents dropped before the server had them (a long outage
    #: filled their memory queue and disk spool…), over every rank: not 0 means
    #: the run has gaps. ``dropped`` says why, ``{reason: n}``, largest first;
    #: the reasons are nand.events.DROP_REASONS (a newer agent may add others).
    messages_dropped: int = 0
    dropped: dict[str, int] = Field(default_factory=dict)


class RankGap(BaseModel):
    """What one rank dropped: the gaps in what the server has of it."""

    rank: int
    messages_dropped: int
    #: ``{reason: n}``, largest first.
    dropped: dict[str, int]


class AttemptInfo(BaseModel):
    """One attempt of a run; ``GET /api/runs/{run}?attempt=N`` reads it."""

    attempt: int
    launch: str | None = None
    started_at: float
    last_seen: float
    #: When a newer attempt replaced it; null for the live attempt.
    superseded_at: float | None = None


class RunDetail(RunSummary):
    verdict: Verdict
    #: Every attempt of the run, oldest first (the last one is the live one).
    attempts: list[AttemptInfo] = Field(default_factory=list)
    modules: list[ModuleInfo] = Field(default_factory=list)
    optimizer: str = ""
    versions: dict[str, str] = Field(default_factory=dict)
    #: The ranks that dropped messages, in rank order (empty: no gaps).
    gaps: list[RankGap] = Field(default_factory=list)


class ModuleInfo(BaseModel):
    name: str
    type: str = ""
    params: int = 0
    order: int | None = None


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


class FlightOut(BaseModel):
    """The flight-recorder window of one rank (default: the origin rank)."""

    run: str
    rank: int
    steps: list[int]
    modules: list[str]
    act_max_abs: list[list[float | None]]
    grad_max_abs: list[list[float | None]]
    grad_norm: list[float | None]
    loss: list[float | None]
    dtype: str = ""
    dtype_max: float | None = None
    #: ``[step index, module index]`` of the cells that were NaN/inf (a null
    #: elsewhere in the matrices means "not recorded").
    act_nonfinite: list[list[int]] = Field(default_factory=list)
    grad_nonfinite: list[list[int]] = Field(default_factory=list)
    #: The run's range of positive finite max|x| over every rank's window and
    #: both views: one colour scale for all of them.
    scale_min: float | None = None
    scale_max: float | None = None


class Problem(BaseModel):
    """Why a request was refused (every 4xx/5xx the API itself answers)."""

    detail: str


class StopRequest(BaseModel):
    reason: str = Field(default="", max_length=500)
    #: Stop at this step boundary; default: the next one every rank can reach.
    step: int | None = Field(default=None, ge=0)


class StopResponse(BaseModel):
    run: str
    step: int
    ranks: list[int]


RunDetail.model_rebuild()
