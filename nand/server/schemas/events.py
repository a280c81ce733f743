"""Events: one non-finite value a rank saw, a page of them, and the run's origin."""

from __future__ import annotations

from pydantic import BaseModel, Field

from nand.events import Cause, Phase


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
