"""Liveness (``/healthz``) and Prometheus metrics (``/metrics``)."""

from __future__ import annotations

import time
from collections import Counter

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from nand import __version__
from nand.server.analysis import alerts, losses, reads
from nand.server.http.api.deps import SessionDep, StateDep
from nand.server.metrics import CONTENT_TYPE
from nand.server.storage import store

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str
    database: str
    ingest: str
    version: str


@router.get(
    "/healthz",
    response_model=Health,
    summary="200 when the database answers and the ingest loop runs, else 503",
    responses={503: {"model": Health}},
)
def healthz(state: StateDep, session: SessionDep) -> Health | JSONResponse:
    try:
        session.execute(text("SELECT 1"))
        database = "ok"
    except SQLAlchemyError as exc:
        database = f"error: {type(exc).__name__}"
    ingest = "ok" if state.ingest is not None and state.ingest.endpoint else "off"
    health = Health(
        status="ok" if database == "ok" else "error",
        database=database,
        ingest=ingest,
        version=__version__,
    )
    if database != "ok":
        return JSONResponse(health.model_dump(), status_code=503)
    return health


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    summary=(
        "Prometheus text format: process metrics, messages in, rejected by reason, events, "
        "runs by state, messages the agents dropped by reason, ingest lag and request "
        "latency histograms"
    ),
)
def metrics(state: StateDep, session: SessionDep) -> PlainTextResponse:
    runs = store.recent_runs(session, limit=10_000)
    summaries = reads.summaries(session, state.settings, runs, time.time())
    by_state: Counter[str] = Counter(s.state for s in summaries)
    dropped = losses.summed(s.dropped for s in summaries)
    gappy = sum(1 for s in summaries if s.messages_dropped)
    warned = alerts.by_kind_live(session)
    body = state.metrics.render(by_state, dropped=dropped, runs_with_gaps=gappy, warnings=warned)
    return PlainTextResponse(body, media_type=CONTENT_TYPE)
