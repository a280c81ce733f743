"""A run's early warnings: loss spikes, growing gradients, headroom (never events)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from nand.server.analysis import alerts
from nand.server.http.api.deps import UNKNOWN_RUN, RunDep, SessionDep
from nand.server.schemas.warnings import WarningOut

router = APIRouter(prefix="/api/runs", tags=["warnings"])


@router.get(
    "/{run}/warnings",
    responses=UNKNOWN_RUN,
    response_model=list[WarningOut],
    summary="A run's early warnings of a blow-up, in step order",
)
def list_warnings(
    run: RunDep, session: SessionDep, limit: Annotated[int, Query(ge=1, le=5000)] = 500
) -> list[WarningOut]:
    return alerts.of_run(session, run.id, limit)
