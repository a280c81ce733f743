"""Per-rank gradient outliers through a real ``nand server`` process (issue 18):
each rank's heartbeats carry its own gradient norms before the all-reduce
(``local_grad_norms``); once every rank's are in for a step, the server names
a rank whose norm stands out as a ``grad_outlier`` warning."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import create_engine, text

from nand.server.analysis.outliers import KEEP_STEPS, PRUNE_EVERY, QUIET_STEPS
from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.processes import ServerProcess


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def server(request, tmp_path_factory) -> Iterator[ServerProcess]:
    """A real server on SQLite, then on PostgreSQL (the norms are written with
    each dialect's own statements)."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('outliers') / 'o.db'}"
        else:
            url = stack.enter_context(request.getfixturevalue("postgres").database())
        process = ServerProcess(url, free_port(), NAND_GRAD_OUTLIER_FACTOR="20").start()
        process.db_url = url  # type: ignore[attr-defined]
        yield process
        process.stop()


def norm(rank: int, step: int) -> float:
    """A healthy spread: the ranks' norms within 30% of each other."""
    return 2.0 + 0.2 * ((rank * 7 + step * 3) % 4)


def ranks(server, run: str, world: int) -> list[FakeAgent]:
    endpoint = server.zmq_endpoint
    agents = [FakeAgent(endpoint, run=run, rank=r, world_size=world) for r in range(world)]
    for agent in agents:
        agent.hello()
    return agents


def beat(agents, steps, odd: dict[tuple[int, int], float] | None = None) -> None:
    """Every rank's heartbeat for ``steps``; ``odd[(rank, step)]`` scales a norm."""
    for agent in agents:
        pairs = [[s, norm(agent.rank, s) * (odd or {}).get((agent.rank, s), 1.0)] for s in steps]
        agent.heartbeat(max(steps), local_grad_norms=pairs)


def finish(agents) -> None:
    for agent in agents:
        agent.bye(0)
        agent.wait_acked()
        agent.close()


def outliers(server, run: str) -> list[tuple[int, int]]:
    listed = httpx.get(f"{server.http_url}/api/runs/{run}/warnings").json()
    return [(w["rank"], w["step"]) for w in listed if w["kind"] == "grad_outlier"]


def test_the_rank_whose_norm_stands_out_is_named_once_at_its_step(server):
    agents = ranks(server, "odd-one", 4)
    beat(agents, range(0, 10))
    beat(agents, range(10, 20), odd={(3, 12): 500.0, (3, 14): 500.0})  # again: quiet
    beat(agents, range(20, 30), odd={(1, 25): 1 / 300})  # another rank, far too small
    finish(agents)
    assert outliers(server, "odd-one") == [(3, 12), (1, 25)]
    listed = httpx.get(f"{server.http_url}/api/runs/odd-one/warnings").json()
    first = listed[0]
    assert first["value"] == pytest.approx(norm(3, 12) * 500)
    assert 2.0 <= first["reference"] <= 2.6  # the median of the four ranks' norms
    assert first["message"].startswith("own gradient norm at step 12, before the all-reduce")
    assert "1/" in listed[1]["message"]  # (too small, said so)
    verdict = httpx.get(f"{server.http_url}/api/runs/odd-one/verdict").json()
    assert verdict["state"] == "finished"  # a warning, never an incident
    assert verdict["warnings"]["by_kind"] == {"grad_outlier": 2}


def test_a_rank_that_keeps_standing_out_warns_again_after_the_quiet_steps(server):
    agents = ranks(server, "lemon", 3)
    late = QUIET_STEPS + 5
    beat(agents, [1, 2, 3, late], odd={(2, 1): 50.0, (2, 2): 50.0, (2, late): 50.0})
    finish(agents)
    assert outliers(server, "lemon") == [(2, 1), (2, late)]


def test_a_step_is_compared_only_once_every_rank_has_sent_it(server):
    agents = ranks(server, "staggered", 3)
    # Ranks 0 and 1 are ahead: step 7 waits for rank 2's next heartbeat.
    for agent in agents[:2]:
        agent.heartbeat(7, local_grad_norms=[[6, 2.0], [7, 2.0]])
    agents[2].heartbeat(6, local_grad_norms=[[6, 2.1]])
    for agent in agents:
        agent.wait_acked()
    assert outliers(server, "staggered") == []
    assert _rows_kept(server, "staggered") == [7, 7]  # step 6 compared and forgotten
    agents[2].heartbeat(7, local_grad_norms=[[7, 900.0]])
    finish(agents)
    assert outliers(server, "staggered") == [(2, 7)]
    assert _rows_kept(server, "staggered") == []


def test_a_step_a_rank_never_sends_is_dropped_once_old(server):
    agents = ranks(server, "gone", 3)
    later = range(KEEP_STEPS + 6, KEEP_STEPS + 6 + PRUNE_EVERY)  # (256 steps a heartbeat)
    for agent in agents[:2]:  # rank 2 died: its steps never complete
        agent.heartbeat(5, local_grad_norms=[[5, 2.0]])
        agent.heartbeat(later[-1], local_grad_norms=[[s, 2.0] for s in later])
    finish(agents)
    assert _rows_kept(server, "gone") == [s for s in later for _ in range(2)]


def test_a_late_ranks_norms_for_steps_already_given_up_do_not_wait(server):
    """A rank far behind the others (its spool replayed after an outage, say)
    sends norms for steps KEEP_STEPS behind the run's newest: the prune would
    delete them uncompared, so they are not written at all."""
    agents = ranks(server, "late-rank", 3)
    ahead = KEEP_STEPS + 300
    for agent in agents[:2]:
        agent.heartbeat(ahead, local_grad_norms=[[ahead, 2.0]])
        agent.wait_acked()
    agents[2].heartbeat(5, local_grad_norms=[[5, 2.0], [6, 2.1]])
    finish(agents)
    assert _rows_kept(server, "late-rank") == [ahead, ahead]


def test_two_ranks_and_a_healthy_spread_never_warn(server):
    pair = ranks(server, "pair", 2)
    beat(pair, range(10), odd={(1, 4): 1000.0})  # which of two is off? nobody can say
    finish(pair)
    healthy = ranks(server, "healthy", 8)
    beat(healthy, range(200))
    finish(healthy)
    assert outliers(server, "pair") == outliers(server, "healthy") == []


def test_a_run_of_two_ranks_keeps_no_norms_waiting(server):
    """Two ranks' norms are never compared, so none wait in the database: a row
    a norm would be the server's work for nothing at every heartbeat."""
    pair = ranks(server, "two-only", 2)
    for agent in pair:  # one heartbeat (one batch) each: the first rank's norms would wait
        agent.heartbeat(9, local_grad_norms=[[s, 2.0] for s in range(10)])
        agent.wait_acked()
    finish(pair)
    assert _rows_kept(server, "two-only") == []


def test_the_factor_is_the_servers_setting(server):
    agents = ranks(server, "factor", 4)
    beat(agents, [1, 2], odd={(0, 1): 15.0, (0, 2): 25.0})  # NAND_GRAD_OUTLIER_FACTOR=20
    finish(agents)
    assert outliers(server, "factor") == [(0, 2)]


def _rows_kept(server, run: str) -> list[int]:
    """The norms still waiting for a run's steps, read from the database."""
    engine = create_engine(server.db_url)
    try:
        with engine.connect() as db:
            found = db.execute(
                text(
                    "SELECT step FROM local_grad_norms JOIN runs ON runs.id = run_id "
                    "WHERE runs.name = :run ORDER BY step, rank"
                ),
                {"run": run},
            )
            return [step for (step,) in found]
    finally:
        engine.dispose()
