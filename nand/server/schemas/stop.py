"""Stopping a run: the request and the answer."""

from __future__ import annotations

from pydantic import BaseModel, Field


class StopRequest(BaseModel):
    reason: str = Field(default="", max_length=500)
    #: Stop at this step boundary; default: the next one every rank can reach.
    step: int | None = Field(default=None, ge=0)


class StopResponse(BaseModel):
    run: str
    step: int
    ranks: list[int]
