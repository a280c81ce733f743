"""Server-Sent Events: ``event: run`` with a RunSummary whenever a run changes.

Each connection subscribes to the server's one poller
(:class:`nand.server.http.hub.StreamHub`): the database is read once per
``poll_s`` (0.5 s) however many streams are open, and each stream is sent
the summaries that differ from what it last sent. The first message per run
comes at once; a client that reads slowly gets the latest state of each run,
not every state in between. ``?run=NAME`` follows one run only (what
``nand wait`` reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from nand.server.http.api.deps import ServerState, StateDep

router = APIRouter(prefix="/api", tags=["stream"])

KEEPALIVE_S = 15.0
#: How often an idle stream looks whether its client is still there.
DISCONNECT_CHECK_S = 1.0


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
    yield "retry: 2000\n\n"
    subscriber = await state.hub.subscribe(run)
    state.metrics.stream_clients(len(state.hub.subscribers))
    last_write = time.monotonic()
    try:
        while not state.closing.is_set() and not await request.is_disconnected():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(subscriber.wake.wait(), DISCONNECT_CHECK_S)
            for update in subscriber.take():
                last_write = time.monotonic()
                yield f"event: run\ndata: {update.body}\n\n"
            if time.monotonic() - last_write > KEEPALIVE_S:
                last_write = time.monotonic()
                yield ": keepalive\n\n"
    finally:
        state.hub.unsubscribe(subscriber)
        state.metrics.stream_clients(len(state.hub.subscribers))
