"""Events of a run: filtered, in logical order, paginated."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from nand.events import Phase
from nand.server.analysis import views
from nand.server.http.api.deps import UNKNOWN_RUN, RunDep, SessionDep
from nand.server.schemas.events import EventPage
from nand.server.storage import store
from nand.server.storage.bounds import INT32

router = APIRouter(prefix="/api/runs", tags=["events"])


@router.get(
    "/{run}/events",
    responses=UNKNOWN_RUN,
    response_model=EventPage,
    summary="A run's events in logical order (step, micro_step, phase, order, rank)",
)
def list_events(
    run: RunDep,
    session: SessionDep,
    rank: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    phase: Annotated[Phase | None, Query()] = None,
    module: Annotated[str | None, Query(max_length=512, pattern=r"^[^\x00]*$")] = None,
    step_min: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    offset: Annotated[int, Query(ge=0, le=INT32)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    where = store.EventFilter(rank, phase, module, step_min, step_max)
    rows, total = store.events_page(session, run.id, where, offset, limit)
    return EventPage(
        items=[views.event_out(row, run.name) for row in rows],
        total=total,
        offset=offset,
        limit=limit,
    )
