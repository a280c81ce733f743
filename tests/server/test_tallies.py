"""A run's tally (``run_tallies``, migration 0013) when its ranks reach two real
``nand server`` processes on one PostgreSQL at the same moment: no count is
lost, and a big run's verdict and /ranks counts read from it are the ones
computed from every rank loaded.

    python -m pytest tests/server/test_tallies.py -q
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from nand.server.analysis import bigrun, rankpage, views
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import Run
from tests.server.agents import FakeAgent
from tests.server.test_big_runs import kept_tally, recounted_tally
from tests.server.test_multi_server import at_once, close, servers, spread

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

WORLD = 48
ORIGIN = 13


def _later(agent: FakeAgent) -> Callable[[], None]:
    """What a rank sends after the quiet gap: each r % 8 a different ending."""
    kind = agent.rank % 8

    def send() -> None:
        if kind == 0:
            return  # silent: lost
        agent.heartbeat(1 if kind == 1 else 2)  # 1: no step progress, stalled
        if kind == 6:  # crashed, then its NaN arrives: diverged and gone
            agent.bye(2, "exception: RuntimeError")
        if agent.rank == ORIGIN:
            agent.event(step=1, phase="forward", module="fc1", cause="produced", nan=1)
        elif kind in (5, 6):
            agent.event(step=1, phase="grad", module="fc1.weight", cause="received", nan=4)
        byes = {2: "exception: RuntimeError", 3: "finished", 4: "exception: StopRequested"}
        if kind in byes:
            agent.bye(2, byes[kind])

    return send


@pytest.fixture
def database(postgres):
    with postgres.database() as url:
        yield url


def test_ranks_reaching_two_servers_at_once_are_tallied_as_every_rank_recounted(database):
    with servers(database, 2) as fleet:
        agents = spread(fleet, "pair", WORLD)
        at_once([lambda a=a: a.heartbeat(1) for a in agents])
        for agent in agents:
            agent.wait_acked(timeout=30)
        quiet_from = time.time()
        time.sleep(2.0)
        loud_from = time.time()
        at_once([_later(a) for a in agents])
        for agent in agents:
            agent.wait_acked(timeout=30)
        close(agents)
    now = time.time()
    # Lost and stalled: silent (or without a new step) since before the gap.
    horizon = now - (quiet_from + loud_from) / 2
    settings = Settings(db_url=database, lost_after_s=horizon, stalled_after_s=horizon)
    engine = create_engine(database)
    try:
        with Session(engine) as session:
            run = session.scalars(select(Run).where(Run.name == "pair")).one()
            recounted = recounted_tally(session, run)
            rows = store.ranks_of(session, [run.id])[run.id]
            every = views.verdict(session, run, rows, settings, now)
            counted = bigrun.verdict(session, run, settings, now)
            page = rankpage.rank_page(session, run, settings, now, None, 10)
            states = Counter(views.rank_states(rows, settings, now).values())
            assert kept_tally(session, run) == recounted
    finally:
        engine.dispose()
    assert recounted == {
        "ranks": WORLD,
        "diverged": 12,
        "diverged_gone": 6,
        "crashed": 6,
        "finished": 12,
    }
    assert set(states) == {"diverged", "lost", "crashed", "finished", "stalled", "running"}
    assert page.states == dict(states) and page.total == WORLD
    assert every.origin is not None and every.origin.rank == ORIGIN
    assert counted.model_dump() == every.model_dump()
