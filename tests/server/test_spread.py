"""How the NaN spread in a big run, kept by a real ``nand server`` from verdict to
verdict (``nand.server.analysis.spread``): after every batch of events its
verdict is the one computed from scratch, on SQLite and on PostgreSQL, also
when a batch moves the origin earlier or replaces a rank's first event.

    python -m pytest tests/server/test_spread.py -q
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from nand.server.analysis import bigrun, spread, views
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import Run
from tests.server.agents import FakeAgent
from tests.server.test_multi_server import TOKEN, servers

#: More than ``Settings.big_run_ranks``: the API reads the run as a big run.
WORLD = 300
RANKS = 40
ALIVE = {"NAND_LOST_AFTER_S": "1e9", "NAND_STALLED_AFTER_S": "1e9"}


def _nan(step: int, phase: str, cause: str, module: str = "blocks.1.fc", order: int = 3) -> dict:
    name = module if phase in ("forward", "backward", "input") else f"{module}.weight"
    return {
        "step": step,
        "micro_step": 0,
        "phase": phase,
        "module": name,
        "module_type": "Linear",
        "order": order,
        "cause": cause,
        "nan": 1,
    }


RECEIVED = _nan(5, "grad", "received")
#: Batches of (rank, event), sent one batch after another.
BATCHES: list[list[tuple[int, dict[str, Any]]]] = [
    # rank 10 produces it in forward; ranks 0-4 receive it through the all-reduce
    [(10, _nan(5, "forward", "produced"))] + [(r, RECEIVED) for r in range(5)],
    # more receivers: only these are new
    [(r, RECEIVED) for r in (*range(5, 10), *range(11, 16))],
    # rank 16 at the origin's point: no rank was first (rank 10 becomes simultaneous)
    [(16, _nan(5, "forward", "produced"))],
    # later on its own, through the next all-gather, a backward of its own
    [
        (17, _nan(7, "forward", "produced")),
        (18, _nan(6, "forward", "propagated", "head")),
        (19, _nan(5, "backward", "produced")),
    ],
    # rank 3's first event replaced by an earlier one of its own (not the origin's)
    [(3, _nan(5, "forward", "propagated", "blocks.0.fc", order=5))],
    # rank 20 went non-finite a step earlier: the origin moves, every relation may change
    [(20, _nan(4, "forward", "produced"))],
    # receivers of the new origin
    [(r, _nan(4, "grad", "received")) for r in range(21, 31)],
    # a batch with no new first event (a rank's second event)
    [(21, _nan(6, "grad", "received"))],
    # a step earlier again: rank 37 in "head"; rank 38 (said received) after it in blocks.1.fc
    [
        (37, _nan(3, "forward", "produced", "head", order=2)),
        (38, _nan(3, "forward", "received", order=5)),
    ],
    # rank 39 before both in blocks.1.fc: rank 38 is at the new origin's point but said it
    # received it there, so it stays received (correlate.same_point)
    [(39, _nan(3, "forward", "produced", order=1))],
]


def _from_scratch(db_url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's verdict with nothing kept (big-run path), and from every rank loaded."""
    settings = Settings(db_url=db_url, lost_after_s=1e9, stalled_after_s=1e9)
    spread.KNOWN.clear()
    bigrun.SPREAD.clear()
    engine = create_engine(db_url)
    try:
        with Session(engine) as session:
            run = session.scalars(select(Run).where(Run.name == "kept")).one()
            now = time.time()
            counted = bigrun.verdict(session, run, settings, now)
            rows = store.ranks_of(session, [run.id])[run.id]
            loaded = views.verdict(session, run, rows, settings, now)
    finally:
        engine.dispose()
    return json.loads(counted.model_dump_json()), json.loads(loaded.model_dump_json())


def test_a_big_runs_verdict_kept_from_batch_to_batch_is_the_one_computed_from_scratch(
    db_url: str,
) -> None:
    with servers(db_url, 1, **ALIVE) as (server,):
        agents = [
            FakeAgent(server.zmq_endpoint, run="kept", rank=r, world_size=WORLD)
            for r in range(RANKS)
        ]
        for agent in agents:
            agent.hello(token=TOKEN)
            agent.heartbeat(1)
        seen = []
        for batch in BATCHES:
            for rank, event in batch:
                agents[rank].event(**event)
            for agent in agents:
                agent.wait_acked(timeout=30)
            response = httpx.get(f"{server.http_url}/api/runs/kept/verdict", timeout=30)
            served = response.raise_for_status().json()
            counted, loaded = _from_scratch(db_url)
            assert served == counted == loaded, len(seen)
            seen.append((served["origin"]["step"], served["simultaneous"]))
        for agent in agents:
            agent.close()
    # (what the batches were for: the origin moved once, simultaneous came and went)
    assert seen[1] == (5, False) and seen[2] == (5, True) and seen[7] == (4, False), seen
    assert seen[8] == (3, False) and seen[9] == (3, False), seen
