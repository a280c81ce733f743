"""Server-Sent Events: ``event: run`` with a RunSummary whenever a run changes.

Stateless: each connection polls the database every ``poll_s`` (0.5 s) for
runs updated since its last look, plus runs seen recently enough that their
state may age into ``lost`` or ``stalled``, and sends the summaries that
differ from what it last sent. The first message per run comes at once.
``?run=NAME`` follows one run only (what ``nand wait`` reads).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nand.server import store, views
from nand.server.api.deps import ServerState, StateDep
from nand.server.schemas import RunSummary

router = APIRouter(prefix="/api", tags=["stream"])

KEEPALIVE_S = 15.0
INITIAL_RUNS = 200


@router.get(
    "/stream",
    response_class=StreamingResponse,
    summary="Server-Sent Events: `run` events carrying a RunSummary JSON when a run changes",
)
async def stream(
    request: Request,
    state: StateDep,
    run: Annotated[str | None, Query(max_length=256, description="only this run")] = None,
) -> StreamingResponse:
    return StreamingResponse(
        _events(request, state, run),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(request: Request, state: ServerState, run: str | None) -> AsyncIterator[str]:
    sent: dict[str, str] = {}
    since: float | None = None
    last_write = time.monotonic()
    yield "retry: 2000\n\n"
    while not state.closing.is_set() and not await request.is_disconnected():
        started = time.time()
        summaries = await run_in_threadpool(_changed, state, since, started, run)
        since = started - 1.0  # overlap: a commit may land during the query
        for summary in summaries:
            body = summary.model_dump_json()
            key = summary.model_dump_json(exclude={"last_seen"})
            if sent.get(summary.run) != key:
                sent[summary.run] = key
                last_write = time.monotonic()
                yield f"event: run\ndata: {body}\n\n"
        if time.monotonic() - last_write > KEEPALIVE_S:
            last_write = time.monotonic()
            yield ": keepalive\n\n"
        await asyncio.sleep(state.settings.poll_s)


def _changed(
    state: ServerState, since: float | None, now: float, only: str | None
) -> list[RunSummary]:
    settings = state.settings
    with Session(state.engine) as session:
        if only is not None:
            found = store.run_by_name(session, only)
            runs = [found] if found is not None else []
        elif since is None:
            runs = list(store.recent_runs(session, INITIAL_RUNS))
        else:
            horizon = max(settings.lost_after_s, settings.stalled_after_s) + 5.0
            runs = list(store.runs_updated_since(session, since, now - horizon))
        ranks = store.ranks_of(session, [r.id for r in runs])
        return [views.run_summary(r, ranks[r.id], settings, now) for r in runs]
