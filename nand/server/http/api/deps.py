"""Dependencies shared by the routers: the server state, a session, the run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, HTTPException, Path, Query, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from nand.runids import run_problem
from nand.server.http.hub import StreamHub
from nand.server.metrics import Metrics
from nand.server.schemas.problem import Problem
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import Run


class IngestLoop(Protocol):
    """What the API reads of the ingest loop (``nand.server.agents.ingest.Ingest``,
    started by ``app.create_app``): the endpoint it is bound to, "" when it is not."""

    @property
    def endpoint(self) -> str: ...


@dataclass
class ServerState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    #: The event streams' one poller.
    hub: StreamHub
    ingest: IngestLoop | None = None
    #: Set when the server is shutting down: long-lived responses (the stream) end.
    closing: threading.Event = field(default_factory=threading.Event)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.nand
    return state


StateDep = Annotated[ServerState, Depends(get_state)]


def get_settings(state: StateDep) -> Settings:
    return state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(state: StateDep) -> Iterator[Session]:
    with Session(state.engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

RunName = Annotated[str, Path(description="The run id (NAND_RUN / TORCHELASTIC_RUN_ID / ...).")]


Attempt = Annotated[
    int | None,
    Query(ge=1, le=1_000_000, description="An earlier attempt of the run (default: the live one)"),
]


def get_run(run: RunName, session: SessionDep, attempt: Attempt = None) -> Run:
    problem = run_problem(run)
    if problem is not None:  # no agent can report it: say why, not just "unknown"
        raise HTTPException(status_code=404, detail=problem)
    found = store.run_by_name(session, run, attempt)
    if found is None:
        which = f"attempt {attempt} of run {run!r}" if attempt else f"run {run!r}"
        raise HTTPException(status_code=404, detail=f"unknown {which}: no agent has reported it")
    return found


RunDep = Annotated[Run, Depends(get_run)]

#: The response every route taking ``{run}`` may give (OpenAPI ``responses=``).
UNKNOWN_RUN: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "Unknown run: no agent has reported it"}
}
