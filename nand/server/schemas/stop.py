"""Stopping a run: the request and the answer."""

from __future__ import annotations

from pydantic import BaseModel, Field

from nand.server.storage.bounds import INT32


class StopRequest(BaseModel):
    reason: str = Field(default="", max_length=500)
    #: Stop at this step boundary; default: the next one every rank can reach.
    #: At most INT32: the largest step the store holds (and an agent sends).
    step: int | None = Field(default=None, ge=0, le=INT32)


class StopResponse(BaseModel):
    run: str
    step: int
    ranks: list[int]
