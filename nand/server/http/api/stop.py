"""Stop a run: every rank stops at the same step boundary.

``POST /api/runs/{run}/stop`` with ``Authorization: Bearer <NAND_TOKEN>``.
The step is the body's ``step`` or, by default, the rule of
:mod:`nand.server.analysis.stoprule`. It is stored in the database; every server's
ingest loop then sends ``{"kind": "command", "command": "stop", "step": S}``
to the run's agents. The first request wins: asking again returns the
recorded step.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated

from fastapi import APIRouter, Body, Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nand.server.analysis import reads, stoprule, views
from nand.server.http.api.deps import RunDep, SessionDep, SettingsDep
from nand.server.schemas.problem import Problem
from nand.server.schemas.stop import StopRequest, StopResponse
from nand.server.storage import store
from nand.server.storage.models import Rank, Run

router = APIRouter(prefix="/api/runs", tags=["stop"])
bearer = HTTPBearer(auto_error=False, description="The server's NAND_TOKEN")


def require_token(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    if not settings.token:
        raise HTTPException(
            403,
            "stopping runs is disabled: start the server with NAND_TOKEN set, "
            "then send 'Authorization: Bearer <token>'",
        )
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), settings.token.encode()):
        raise HTTPException(
            401,
            "a valid token is required: 'Authorization: Bearer <NAND_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


@router.post(
    "/{run}/stop",
    response_model=StopResponse,
    dependencies=[Depends(require_token)],
    summary="Stop every rank of a run at one step boundary",
    responses={
        400: {"model": Problem, "description": "The body could not be read as JSON"},
        401: {"model": Problem, "description": "Missing or wrong token"},
        403: {
            "model": Problem,
            "description": "The server has no NAND_TOKEN: stopping is disabled",
        },
        404: {"model": Problem, "description": "Unknown run"},
        409: {
            "model": Problem,
            "description": "No rank is left running, the step has passed, or the attempt "
            "asked for is not the live one",
        },
        413: {"model": Problem, "description": "The body is over 64 KiB"},
    },
)
def stop_run(
    run: RunDep,
    session: SessionDep,
    settings: SettingsDep,
    request: Annotated[StopRequest | None, Body()] = None,
) -> StopResponse:
    request = request or StopRequest()
    if run.superseded_at is not None:
        raise HTTPException(409, f"attempt {run.attempt} of {run.name!r} is over: a newer one runs")
    ranks = store.ranks_of(session, [run.id])[run.id]
    if run.stop_step is None:
        _check_stoppable(session, run, ranks, settings)
        step = _choose_step(run, [r for r, _ in ranks], request, settings)
        store.request_stop(session, run.id, step, request.reason, time.time())
        session.commit()
        session.refresh(run)
    running = views.live_ranks(ranks, settings, time.time())
    return StopResponse(run=run.name, step=int(run.stop_step or 0), ranks=running)


def _check_stoppable(
    session: SessionDep, run: Run, ranks: views.RankRows, settings: SettingsDep
) -> None:
    """Refuse a stop that no rank would ever receive."""
    if views.live_ranks(ranks, settings, time.time()):
        return
    summary = reads.Reads(session, settings, [run]).summary(run, time.time())
    raise HTTPException(
        409,
        f"run {run.name!r} has no rank left to stop: every rank has exited or is lost "
        f"(the run is {summary.state})",
    )


def _choose_step(run: Run, ranks: list[Rank], request: StopRequest, settings: SettingsDep) -> int:
    latest = max([run.latest_step, *(r.step for r in ranks)])
    if request.step is None:
        return stoprule.stop_step([latest], [r.steps_per_s for r in ranks], settings.heartbeat_s)
    if request.step <= latest:
        raise HTTPException(409, f"step {request.step} has passed: the latest step is {latest}")
    return request.step
