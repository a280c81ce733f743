"""Runs: the list's summary and one run's detail (its attempts, modules, gaps)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from nand.events import RunState
from nand.server.schemas.events import Origin
from nand.server.schemas.verdict import Verdict


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


class ModuleInfo(BaseModel):
    name: str
    type: str = ""
    params: int = 0
    order: int | None = None


class RunDetail(RunSummary):
    verdict: Verdict
    #: Every attempt of the run, oldest first (the last one is the live one).
    attempts: list[AttemptInfo] = Field(default_factory=list)
    modules: list[ModuleInfo] = Field(default_factory=list)
    optimizer: str = ""
    versions: dict[str, str] = Field(default_factory=dict)
    #: The ranks that dropped messages, in rank order (empty: no gaps).
    gaps: list[RankGap] = Field(default_factory=list)
