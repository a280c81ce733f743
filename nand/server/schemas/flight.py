"""The flight recorder: one rank's window of per-layer max|x| before the incident."""

from __future__ import annotations

from pydantic import BaseModel, Field


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
