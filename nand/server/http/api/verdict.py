"""The verdict: the one call a scheduler polls."""

from __future__ import annotations

import time

from fastapi import APIRouter

from nand.server.analysis import reads
from nand.server.http.api.deps import UNKNOWN_RUN, RunDep, SessionDep, SettingsDep
from nand.server.schemas.verdict import Verdict

router = APIRouter(prefix="/api/runs", tags=["verdict"])


@router.get(
    "/{run}/verdict",
    responses=UNKNOWN_RUN,
    response_model=Verdict,
    summary="Is this run healthy, and if not, where did it first go non-finite?",
    description=(
        "state: `diverged` if any rank saw a non-finite value; else `lost` if a rank sent "
        "nothing for NAND_LOST_AFTER_S; else `stalled` if a rank made no step progress for "
        "NAND_STALLED_AFTER_S; `finished` when every rank said bye; else `healthy`."
    ),
)
def get_verdict(run: RunDep, session: SessionDep, settings: SettingsDep) -> Verdict:
    return reads.Reads(session, settings, [run]).verdict(run, time.time())
