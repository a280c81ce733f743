"""Hosts across runs, worst first: a node that keeps producing incidents."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from nand.server.analysis import hosts
from nand.server.http.api.deps import SessionDep
from nand.server.schemas.hosts import HostPage
from nand.server.storage import store

router = APIRouter(prefix="/api/hosts", tags=["hosts"])

#: The most recent runs looked at (as ``/metrics`` does).
RECENT_RUNS = 10_000


@router.get(
    "",
    response_model=HostPage,
    summary="Hosts by incidents, replica mismatches and crashes across recent runs",
    description=(
        "Over the last 10,000 runs: per host (and per GPU on it, from the ranks' devices), "
        "the runs whose lone origin of a non-finite value ran there (`incidents`), the runs "
        "in which a rank there held parameters unlike the other replicas' (`mismatches`) "
        "and the ranks there that crashed. A host at the top run after run is suspect."
    ),
)
def list_hosts(session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> HostPage:
    runs = store.recent_runs(session, limit=RECENT_RUNS)
    found = hosts.tally(runs, store.ranks_of(session, [run.id for run in runs]))
    return HostPage(items=found[:limit], total=len(found), runs=len(runs))
