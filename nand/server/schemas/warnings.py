"""Early warnings: one rank's alert while its values are still finite, and a run's tally."""

from __future__ import annotations

from pydantic import BaseModel, Field

from nand.events import WarningKind


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
