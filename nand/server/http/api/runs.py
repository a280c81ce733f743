"""Runs: the list, one run's detail, its ranks, its heartbeat series, its flight window."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from nand.server.analysis import rankpage, reads, series
from nand.server.http.api.deps import UNKNOWN_RUN, RunDep, SessionDep, SettingsDep
from nand.server.schemas.flight import FlightOut
from nand.server.schemas.problem import Problem
from nand.server.schemas.ranks import RankPage, RankSeries, SeriesPoint
from nand.server.schemas.runs import RunDetail, RunSummary
from nand.server.storage import store
from nand.server.storage.bounds import INT32
from nand.server.storage.sanitize import finite

router = APIRouter(prefix="/api/runs", tags=["runs"])


@router.get("", response_model=list[RunSummary], summary="Runs, most recently seen first")
def list_runs(
    session: SessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=INT32)] = 0,
) -> list[RunSummary]:
    runs = store.recent_runs(session, limit, offset)
    return reads.summaries(session, settings, runs, time.time())


@router.get(
    "/{run}", responses=UNKNOWN_RUN, response_model=RunDetail, summary="One run, with its verdict"
)
def get_run(run: RunDep, session: SessionDep, settings: SettingsDep) -> RunDetail:
    return reads.Reads(session, settings, [run]).run_detail(run, time.time())


@router.get(
    "/{run}/ranks",
    responses=UNKNOWN_RUN,
    response_model=RankPage,
    summary="The run's ranks in rank order, a page at a time, with counts by state",
)
def get_ranks(
    run: RunDep,
    session: SessionDep,
    settings: SettingsDep,
    after: Annotated[
        int | None,
        Query(ge=0, le=INT32, description="Ranks above this one (the last page's `next_after`)"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> RankPage:
    return rankpage.rank_page(session, run, settings, time.time(), after, limit)


@router.get(
    "/{run}/series",
    responses=UNKNOWN_RUN,
    response_model=list[RankSeries],
    summary=(
        "Heartbeat telemetry per rank, downsampled to at most `points` per rank, "
        "`limit` ranks at a time"
    ),
)
def get_series(
    run: RunDep,
    session: SessionDep,
    points: Annotated[int, Query(ge=2, le=5000)] = 500,
    after: Annotated[
        int | None, Query(ge=0, le=INT32, description="Ranks above this one (paging by rank)")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=5000, description="Most ranks in the answer")] = 1000,
) -> list[RankSeries]:
    return [
        RankSeries(rank=rank, points=[_point(row) for row in rows])
        for rank, rows in series.series(session, run.id, points, after, limit).items()
    ]


def _point(row: tuple) -> SeriesPoint:
    time_, step, loss, grad_norm, steps_per_s, max_activation = row
    return SeriesPoint(
        time=float(time_),
        step=int(step),
        loss=finite(loss),
        grad_norm=finite(grad_norm),
        steps_per_s=finite(steps_per_s),
        max_activation=finite(max_activation),
    )


@router.get(
    "/{run}/flight",
    response_model=FlightOut,
    summary="The latest flight-recorder window of a rank (default: the origin rank)",
    responses={404: {"model": Problem, "description": "Unknown run, or no window from that rank"}},
)
def get_flight(
    run: RunDep,
    session: SessionDep,
    settings: SettingsDep,
    rank: Annotated[int | None, Query(ge=0, le=INT32)] = None,
) -> FlightOut:
    if rank is None:
        summary = reads.Reads(session, settings, [run]).summary(run, 0.0)
        if summary.origin is None:
            raise HTTPException(404, f"run {run.name!r} has no origin yet: pass ?rank=")
        # Simultaneous ranks have no first one: show the lowest of them.
        rank = summary.origin.rank if summary.origin.rank is not None else summary.origin.ranks[0]
    flight = store.latest_flight(session, run.id, rank)
    if flight is None:
        raise HTTPException(404, f"no flight-recorder window from rank {rank} of {run.name!r}")
    low, high = store.flight_scale(session, run.id)
    return _flight_out(run.name, rank, flight.data).model_copy(
        update={"scale_min": low, "scale_max": high}
    )


def _flight_out(run: str, rank: int, data: dict[str, Any]) -> FlightOut:
    dtype_max = finite(data.get("dtype_max"))
    return FlightOut(
        act_nonfinite=_cells(data, "act_nonfinite"),
        grad_nonfinite=_cells(data, "grad_nonfinite"),
        run=run,
        rank=rank,
        steps=[
            s if isinstance(s, int) and not isinstance(s, bool) else 0 for s in _list(data, "steps")
        ],
        modules=[str(m) for m in _list(data, "modules")],
        act_max_abs=[[finite(v) for v in _as_list(row)] for row in _list(data, "act_max_abs")],
        grad_max_abs=[[finite(v) for v in _as_list(row)] for row in _list(data, "grad_max_abs")],
        grad_norm=[finite(v) for v in _list(data, "grad_norm")],
        loss=[finite(v) for v in _list(data, "loss")],
        dtype=str(data.get("dtype") or ""),
        dtype_max=dtype_max,
    )


def _cells(data: dict[str, Any], key: str) -> list[list[int]]:
    return [
        [int(c[0]), int(c[1])]
        for c in _list(data, key)
        if isinstance(c, list) and len(c) == 2 and all(isinstance(i, int) for i in c)
    ]


def _list(data: dict[str, Any], key: str) -> list[Any]:
    return _as_list(data.get(key))


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
