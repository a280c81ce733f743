"""The database tables (SQLAlchemy 2.0). The REST bodies are in ``schemas/``.

Times are Unix seconds (float). Hot paths keep small cached rows so the
verdict never scans events: per rank, ``ranks.first_event_id`` with its
logical sort key, maintained at ingest by a conditional update (safe with
several servers on one database); a run's origin is the least of its ranks'.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: 64-bit ids that are still SQLite rowid aliases (autoincrementing).
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One attempt of a run: a run id used again (a re-applied Kubernetes Job, a
    requeued Slurm job) is a new attempt, see :mod:`nand.server.agents.attempts`."""

    __tablename__ = "runs"
    __table_args__ = (UniqueConstraint("name", "attempt", name="uq_runs_name_attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(256), index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    #: When a newer attempt replaced this one (null: the live attempt).
    superseded_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: The agents' ``NAND_LAUNCH``: one launch is one attempt (null: not sent).
    launch: Mapped[str | None] = mapped_column(String(256), nullable=True)
    world_size: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float, index=True)
    #: Bumped when something a viewer shows changes (new rank, event, stop, bye).
    updated_at: Mapped[float] = mapped_column(Float, index=True)
    latest_step: Mapped[int] = mapped_column(Integer, default=0)
    event_count: Mapped[int] = mapped_column(BigInteger, default=0)
    optimizer: Mapped[str] = mapped_column(String(256), default="")
    modules: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    versions: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    stop_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    stop_requested_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    stop_reason: Mapped[str] = mapped_column(String(500), default="")
    #: The DDP replicas' comparison (nand.server.analysis.replicas): the first step at
    #: which a rank's parameters differed, the last at which all agreed, the
    #: ranks that differed and the parameters that did (null: none seen).
    replica_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    replica_good_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    replica_ranks: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    replica_params: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    #: Early warnings stored for the run (``warnings``).
    warning_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


#: A rank that has neither diverged nor said bye: lost, stalled or running by the clock.
RANK_OPEN = "first_event_id IS NULL AND finished_at IS NULL"
#: A rank's cached first event's logical key (and its rank: ties go to the lowest).
FIRST_KEY = ("run_id", "first_step", "first_micro_step", "first_phase_rank", "first_order", "rank")
#: A rank that said bye without diverging: crashed or finished.
RANK_CLOSED = "first_event_id IS NULL AND finished_at IS NOT NULL"


def _partial(name: str, where: str, *columns: str) -> Index:
    """An index of the rows ``where`` holds (SQLite and PostgreSQL both have them)."""
    return Index(name, *columns, sqlite_where=text(where), postgresql_where=text(where))


class Rank(Base):
    __tablename__ = "ranks"
    __table_args__ = (
        Index("ix_ranks_run_rank", "run_id", "rank", unique=True),
        # A big run's lost and stalled ranks, counted by range (nand.server.analysis.counts):
        _partial("ix_ranks_open_seen", RANK_OPEN, "run_id", "last_seen"),
        # (last_seen too: the stalled count reads no row; the entry moves on each
        # heartbeat anyway, as its step moves on)
        _partial("ix_ranks_open_step", RANK_OPEN, "run_id", "step_changed_at", "last_seen"),
        _partial("ix_ranks_closed", RANK_CLOSED, "run_id", "rank"),
        _partial("ix_ranks_dropped", "dropped IS NOT NULL", "run_id", "rank"),
        # The origin: the least first key of the diverged ranks (bigrun.origin).
        _partial("ix_ranks_first_key", "first_event_id IS NOT NULL", *FIRST_KEY),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer, default=0)
    host: Mapped[str] = mapped_column(String(256), default="")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    step: Mapped[int] = mapped_column(Integer, default=0)
    #: When ``step`` last grew (stalled detection).
    step_changed_at: Mapped[float] = mapped_column(Float)
    steps_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_activation: Mapped[float | None] = mapped_column(Float, nullable=True)
    amp_skipped: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    bye_reason: Mapped[str] = mapped_column(String(500), default="")
    device: Mapped[str] = mapped_column(String(64), default="")
    first_event_id: Mapped[int | None] = mapped_column(BigId, nullable=True)
    first_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    first_micro_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    first_phase_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    first_order: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Messages its agents dropped before the server had them, ``{reason: n}``:
    #: the sum over its agents of each one's latest cumulative count (``drops``);
    #: null: none reported.
    dropped: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)


class RunTally(Base):
    """A run's ranks counted by what the ingest knows, in ``correlate.rank_state``'s
    order: every rank seen, diverged (has a first non-finite event; ``diverged_gone``:
    and said bye), and of the others crashed (a bye with an exception) and
    finished (any other bye). Kept by triggers on ``ranks`` (migration 0013) in the
    transaction that changes a rank, as ``n = n + d`` on this row, so several
    servers on one database never lose an update. The rest are open ranks: lost,
    stalled or running by the clock (``nand.server.analysis.counts``)."""

    __tablename__ = "run_tallies"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    diverged: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    diverged_gone: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    crashed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    finished: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_logical", "run_id", "step", "micro_step", "phase_rank", "ord"),
        # The whole key: ingest finds a just-stored first event by it (firsts.event_id).
        Index("ix_events_rank_key", "run_id", "rank", "step", "micro_step", "phase_rank", "ord"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer, default=0)
    host: Mapped[str] = mapped_column(String(256), default="")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer)
    micro_step: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(32))
    phase_rank: Mapped[int] = mapped_column(Integer)
    module: Mapped[str] = mapped_column(String(512))
    module_type: Mapped[str] = mapped_column(String(256), default="")
    ord: Mapped[int] = mapped_column(Integer)
    cause: Mapped[str] = mapped_column(String(32))
    call: Mapped[int] = mapped_column(Integer, default=0)
    nan: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    posinf: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    neginf: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    min: Mapped[float | None] = mapped_column(Float, nullable=True)
    max: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_abs: Mapped[float | None] = mapped_column(Float, nullable=True)
    shape: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    dtype: Mapped[str] = mapped_column(String(64), default="")
    time: Mapped[float] = mapped_column(Float)
    seq: Mapped[int] = mapped_column(BigInteger, default=0)
    message: Mapped[str] = mapped_column(Text, default="")
    #: The value kinds in words ("NaN and +inf"), kept because SQLite stores a
    #: NaN min/max (how an activation event says NaN) as NULL.
    kinds: Mapped[str] = mapped_column(String(80), default="")
    #: The replay of the step (``nand.events.Event``): op, user's line, reproduced, note.
    op: Mapped[str] = mapped_column(String(128), default="")
    source: Mapped[str] = mapped_column(String(1024), default="")
    reproduced: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    replay: Mapped[str] = mapped_column(String(300), default="")
    #: The collective a received value came through (``nand.events.Event.via``).
    via: Mapped[str] = mapped_column(String(80), default="")


class Heartbeat(Base):
    __tablename__ = "heartbeats"
    __table_args__ = (Index("ix_heartbeats_run_rank", "run_id", "rank", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    time: Mapped[float] = mapped_column(Float)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    steps_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_activation: Mapped[float | None] = mapped_column(Float, nullable=True)


class Flight(Base):
    """A flight-recorder window, with the evidence the hint needs precomputed."""

    __tablename__ = "flights"
    __table_args__ = (Index("ix_flights_run_rank", "run_id", "rank", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    time: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(String(500), default="")
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    overflow: Mapped[bool] = mapped_column(default=False)
    grad_rising: Mapped[bool] = mapped_column(default=False)
    #: One phrase of evidence for the summary (e.g. "max |x| reached 6.1e4 of 65504").
    evidence: Mapped[str] = mapped_column(String(500), default="")
    #: The window's smallest and largest positive finite max|x| (the shared colour scale).
    mag_min: Mapped[float | None] = mapped_column(Float, nullable=True)
    mag_max: Mapped[float | None] = mapped_column(Float, nullable=True)


class Message(Base):
    """One row per accepted agent message: the (agent, seq) dedup key."""

    __tablename__ = "messages"

    agent: Mapped[str] = mapped_column(String(128), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)


class Agent(Base):
    """Agents that said hello (with a valid token when one is required)."""

    __tablename__ = "agents"

    agent: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    hello_at: Mapped[float] = mapped_column(Float)


class AgentLease(Base):
    """Which server speaks for an agent id, until ``expires`` (its clock):
    ``nand.server.agents.leases``. ``server`` is the host name and the bound ZeroMQ
    endpoint, so a server restarted on the same address keeps its agents."""

    __tablename__ = "agent_leases"

    agent: Mapped[str] = mapped_column(String(128), primary_key=True)
    server: Mapped[str] = mapped_column(String(300), index=True)
    expires: Mapped[float] = mapped_column(Float)


class Drop(Base):
    """An agent's cumulative count of dropped messages for one reason, as its
    heartbeats report it: the largest seen is kept (heartbeats repeat, arrive
    late or out of order), so a count never goes back. A rank's agents (a
    forked worker, a second ``nand.watch``, a restarted process) each count
    from 0; ``ranks.dropped`` is their sum."""

    __tablename__ = "drops"
    __table_args__ = (Index("ix_drops_run_rank", "run_id", "rank"),)

    agent: Mapped[str] = mapped_column(String(128), primary_key=True)
    reason: Mapped[str] = mapped_column(String(40), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    count: Mapped[int] = mapped_column(BigInteger, default=0)


class Fingerprint(Base):
    """One rank's parameter fingerprint at one step: one integer per parameter
    (``names``/``values``) and a digest of them all. Only a run's latest steps
    are kept; what the comparison found stays on the run."""

    __tablename__ = "fingerprints"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    names: Mapped[list[str]] = mapped_column(JSON)
    values: Mapped[list[int]] = mapped_column(JSON)
    #: The ranks that hold the same tensors: HSDP's shard coordinates, as
    #: "1" or "0,2" ("": every rank, DDP). Compared within a group only.
    replica_group: Mapped[str] = mapped_column(String(64), default="", server_default="")


class LocalGradNorm(Base):
    """One DDP rank's own gradient norm (before the all-reduce) at one step,
    until every rank's is in and they are compared (nand.server.analysis.outliers)."""

    __tablename__ = "local_grad_norms"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    norm: Mapped[float] = mapped_column(Float)


class WarningRow(Base):
    """An early warning from one rank (``nand.events.Alert``): never an event."""

    __tablename__ = "warnings"
    __table_args__ = (Index("ix_warnings_run_step", "run_id", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(40))
    module: Mapped[str] = mapped_column(String(512), default="")
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    reference: Mapped[float | None] = mapped_column(Float, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    time: Mapped[float] = mapped_column(Float)


class Notification(Base):
    """A state change to tell one ``NAND_NOTIFY_URL``: the outbox of
    ``nand.server.notify.notifier``, kept until delivered. ``state`` is the key sent
    once per attempt (``diverged``, ``warning:loss_spike``...); ``target`` is a
    digest of the URL, so a webhook's secret path is never stored."""

    __tablename__ = "notifications"
    __table_args__ = (
        UniqueConstraint("run_id", "state", "target", name="uq_notifications_run_state_target"),
        Index("ix_notifications_due", "delivered_at", "next_try"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    created: Mapped[float] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_try: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_error: Mapped[str] = mapped_column(String(500), default="", server_default="")
