"""Runs of thousands of ranks: what the server does per message and per request
must not grow with the number of ranks in the run.

Work is counted, not timed (the test machine is shared): SQLite's virtual
machine instructions for the ingest, SQL statements for a request.

    python -m pytest tests/server/test_big_runs.py -q
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session

from nand import wire
from nand.events import FlightWindow
from nand.server.agents.writer import write_batch
from nand.server.analysis import bigrun, correlate, rankpage, series, spread, views
from nand.server.settings import Settings
from nand.server.storage import migrate, store
from nand.server.storage.models import Run, RunTally


def _hello(run: str, rank: int, world: int) -> dict[str, Any]:
    body = {"world_size": world, "host": f"node{rank // 8}", "pid": 1000 + rank}
    message = wire.agent_message(
        "hello", agent=f"{run}-{rank}", seq=1, run=run, rank=rank, body=body
    )
    return wire.decode(wire.encode(message))


class VmSteps:
    """SQLite virtual-machine instructions run on ``engine``'s connections, in
    thousands (``per``: instructions per count)."""

    def __init__(self, engine: Engine, per: int = 1000) -> None:
        self.count = 0
        self.per = per
        event.listen(engine, "connect", self._connected)

    def _connected(self, dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.set_progress_handler(self._tick, self.per)

    def _tick(self) -> int:
        self.count += 1
        return 0


def _hellos_cost(engine: Engine, steps: VmSteps, run: str, ranks: range, world: int) -> int:
    before = steps.count
    write_batch(engine, [_hello(run, r, world) for r in ranks], time.time())
    return steps.count - before


def test_a_new_ranks_hello_costs_the_same_in_a_run_of_200_and_of_4000_ranks(tmp_path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'n.db'}")
    steps = VmSteps(engine)
    migrate.upgrade(engine)
    write_batch(engine, [_hello("small", r, 400) for r in range(200)], time.time())
    write_batch(engine, [_hello("wide", r, 4200) for r in range(4000)], time.time())

    small = _hellos_cost(engine, steps, "small", range(200, 400), 400)
    wide = _hellos_cost(engine, steps, "wide", range(4000, 4200), 4200)

    # Each hello used to read every rank already in the run (20 times more here).
    assert wide < 3 * small, (small, wide)


RANKS = 3000
ORIGIN = 2500
SETTINGS = Settings(db_url="sqlite://", lost_after_s=60.0, stalled_after_s=300.0, big_run_ranks=256)


def _message(run: str, rank: int, seq: int, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    message = wire.agent_message(
        kind, agent=f"{run}-{rank}", seq=seq, run=run, rank=rank, body=body
    )
    return wire.decode(wire.encode(message))


def _nan(rank: int, step: int, phase: str, cause: str, world: int) -> dict[str, Any]:
    module = "blocks.1.fc" if phase == "forward" else "blocks.1.fc.weight"
    event = {
        "step": step,
        "micro_step": 0,
        "phase": phase,
        "module": module,
        "module_type": "Linear",
        "order": 3,
        "cause": cause,
        "nan": 1,
        "world_size": world,
    }
    return {"event": event, "flight": None}


def _later(run: str, rank: int, world: int) -> list[dict[str, Any]]:
    """What rank ``rank`` sends in the last ten seconds: each a different ending."""
    beat = {"step": 1 if rank % 7 == 1 else 2, "steps_per_s": 1.0}
    if rank % 501 == 3:
        beat["dropped"] = {"spool_full": rank}
    out = [] if rank % 7 == 0 else [_message(run, rank, 3, "heartbeat", beat)]  # lost: silent
    byes = {2: "exception: RuntimeError", 3: "finished", 4: "exception: StopRequested"}
    if rank % 7 in byes:
        out.append(_message(run, rank, 4, "bye", {"step": 2, "reason": byes[rank % 7]}))
    if rank == ORIGIN or rank % 97 == 1:
        out.append(
            _message(
                run,
                rank,
                5,
                "event",
                _nan(rank, 5 if rank == ORIGIN else 7, "forward", "produced", world),
            )
        )
    elif rank % 5 == 0:
        out.append(_message(run, rank, 5, "event", _nan(rank, 5, "grad", "received", world)))
    return out


def _mixed_run(engine: Engine, run: str, world: int, now: float) -> None:
    """Ranks lost, stalled, crashed, finished, stopped, running, diverged (produced,
    received, later on their own), some with gaps; a stop requested."""
    first = [
        m
        for r in range(world)
        for m in (
            _message(run, r, 1, "hello", {"world_size": world, "host": f"n{r // 8}", "pid": r + 1}),
            _message(run, r, 2, "heartbeat", {"step": 1, "steps_per_s": 1.0}),
        )
    ]
    for start in range(0, len(first), 2000):
        write_batch(engine, first[start : start + 2000], now - 1000)
    later = [m for r in range(world) for m in _later(run, r, world)]
    for start in range(0, len(later), 2000):
        write_batch(engine, later[start : start + 2000], now - 10)
    with Session(engine) as session, session.begin():
        store.request_stop(session, _run(session, run).id, 3, "test", now - 20)


def _run(session: Session, name: str) -> Run:
    return session.scalars(select(Run).where(Run.name == name)).one()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, float]:
    engine = create_engine(f"sqlite:///{tmp_path_factory.mktemp('big') / 'n.db'}")
    migrate.upgrade(engine)
    now = time.time()
    _mixed_run(engine, "wide", RANKS, now)
    _mixed_run(engine, "narrow", 600, now)
    return engine, now


def test_a_big_runs_verdict_counted_by_the_database_is_the_one_from_every_rank(mixed) -> None:
    engine, now = mixed
    with Session(engine) as session:
        run = _run(session, "wide")
        recounted = views.verdict(
            session, run, store.ranks_of(session, [run.id])[run.id], SETTINGS, now
        )
        counted = bigrun.verdict(session, run, SETTINGS, now)
    # (the silent ranks went first: 990 s before the NaN)
    assert recounted.state == "lost" and recounted.origin.rank == ORIGIN
    assert {f.state for f in recounted.failures} == {"diverged", "lost", "crashed", "stalled"}
    assert recounted.stop is not None and recounted.stop.stopped_at == 2
    assert recounted.ranks_with_gaps and "received" in recounted.summary
    assert counted.model_dump() == recounted.model_dump()


def test_a_big_runs_detail_and_ranks_page_agree_with_every_rank_loaded(mixed) -> None:
    engine, now = mixed
    with Session(engine) as session:
        run = _run(session, "wide")
        rows = store.ranks_of(session, [run.id])[run.id]
        recounted = views.run_detail(session, run, rows, SETTINGS, now)
        counted = bigrun.run_detail(session, run, SETTINGS, now)
        page = rankpage.rank_page(session, run, SETTINGS, now, after=None, limit=100)
        states = Counter(views.rank_states(rows, SETTINGS, now).values())
    assert counted.model_dump() == recounted.model_dump()
    assert page.states == dict(states) and page.total == RANKS
    assert set(states) == {"diverged", "lost", "crashed", "finished", "stalled", "running"}


def _statements(engine: Engine, call: Callable[[Session], object]) -> int:
    count = [0]

    def counted(*_: object) -> None:
        count[0] += 1

    bigrun.SPREAD.clear()  # (the uncached path: each run's first verdict)
    spread.KNOWN.clear()
    event.listen(engine, "before_cursor_execute", counted)
    try:
        with Session(engine) as session:
            call(session)
    finally:
        event.remove(engine, "before_cursor_execute", counted)
    return count[0]


@pytest.mark.parametrize("what", ["verdict", "detail", "ranks", "series"])
def test_a_request_about_a_run_runs_as_many_statements_at_3000_ranks_as_at_600(
    mixed, what: str
) -> None:
    engine, now = mixed
    requests = {
        "verdict": lambda s, run: bigrun.verdict(s, run, SETTINGS, now),
        "detail": lambda s, run: bigrun.run_detail(s, run, SETTINGS, now),
        "ranks": lambda s, run: rankpage.rank_page(s, run, SETTINGS, now, None, 500),
        "series": lambda s, run: series.series(s, run.id, 100, None, 500),
    }
    counts = {
        name: _statements(engine, lambda s, name=name: requests[what](s, _run(s, name)))
        for name in ("narrow", "wide")
    }
    assert counts["wide"] == counts["narrow"] < 20, counts


def test_a_new_event_in_a_big_run_shows_in_the_next_verdict(mixed) -> None:
    engine, now = mixed
    quiet = 2  # (no event yet, see _later)
    with Session(engine) as session:
        assert (
            quiet
            not in bigrun.verdict(session, _run(session, "narrow"), SETTINGS, now).ranks_affected
        )
    event = _message("narrow", quiet, 9, "event", _nan(quiet, 5, "grad", "received", 600))
    write_batch(engine, [event], now - 5)
    with Session(engine) as session:
        run = _run(session, "narrow")
        counted = bigrun.verdict(session, run, SETTINGS, now)
        recounted = views.verdict(
            session, run, store.ranks_of(session, [run.id])[run.id], SETTINGS, now
        )
    assert quiet in counted.ranks_affected
    assert counted.model_dump() == recounted.model_dump()


def recounted_tally(session: Session, run: Run) -> dict[str, int]:
    """The run's tally recounted from every rank row (``correlate``'s rules)."""
    rows = store.ranks_of(session, [run.id])[run.id]
    diverged = [rank for rank, first in rows if first is not None]
    others = [rank for rank, first in rows if first is None]
    crashed = [r for r in others if correlate.crashed_bye(r.bye_reason or "")]
    return {
        "ranks": len(rows),
        "diverged": len(diverged),
        "diverged_gone": sum(1 for r in diverged if r.finished_at is not None),
        "crashed": len(crashed),
        "finished": sum(1 for r in others if r.finished_at is not None) - len(crashed),
    }


def kept_tally(session: Session, run: Run) -> dict[str, int]:
    row = session.get(RunTally, run.id)
    assert row is not None
    return {name: getattr(row, name) for name in ("ranks", "diverged", "diverged_gone")} | {
        "crashed": row.crashed,
        "finished": row.finished,
    }


@pytest.mark.parametrize("name", ["narrow", "wide"])
def test_the_tallies_kept_by_the_ingest_equal_the_ranks_recounted(mixed, name: str) -> None:
    engine, _ = mixed
    with Session(engine) as session:
        run = _run(session, name)
        recounted = recounted_tally(session, run)
        assert all(recounted.values()), recounted  # (every class occurs)
        assert kept_tally(session, run) == recounted


def _calm_run(engine: Engine, run: str, world: int, now: float, flights: bool = False) -> None:
    """Every rank alive and reporting; two in three received a NaN, rank 7 produced it
    (``flights``: each with its flight window, as the agent sends one)."""
    window = FlightWindow(steps=[1, 2], modules=["blocks.1.fc"], act_max_abs=[[1.0], [2.0]])
    messages = []
    for r in range(world):
        hello = {"world_size": world, "host": f"n{r // 8}", "pid": r + 1}
        messages += [
            _message(run, r, 1, "hello", hello),
            _message(run, r, 2, "heartbeat", {"step": 3, "steps_per_s": 1.0}),
        ]
        if r == 7 or r % 3:
            phase, cause = ("forward", "produced") if r == 7 else ("grad", "received")
            event = _nan(r, 2, phase, cause, world)
            event["flight"] = window.to_dict() if flights else None
            messages.append(_message(run, r, 3, "event", event))
    for start in range(0, len(messages), 2000):
        write_batch(engine, messages[start : start + 2000], now)


def test_a_big_runs_ranks_page_verdict_and_summary_read_as_much_at_3000_ranks_as_at_600(
    tmp_path,
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'n.db'}")
    steps = VmSteps(engine, per=100)
    migrate.upgrade(engine)
    now = time.time()
    _calm_run(engine, "narrow", 600, now, flights=True)
    _calm_run(engine, "wide", 3000, now, flights=True)

    def cost(name: str, call: Callable[[Session, Run], object]) -> int:
        with Session(engine) as session:
            run = _run(session, name)
            call(session, run)  # (a verdict keeps the spread: the next one is a poll)
            before = steps.count
            call(session, run)
            return steps.count - before

    for call in (
        lambda s, run: rankpage.rank_page(s, run, SETTINGS, now, 400, 100),
        lambda s, run: bigrun.verdict(s, run, SETTINGS, now),
        lambda s, run: rankpage.run_summary(s, run, SETTINGS, now),
    ):
        narrow, wide = cost("narrow", call), cost("wide", call)
        # Counting the ranks by state read every rank row (5 times more here), and
        # a page every rank's flight windows; the slack: a few index levels more,
        # and the counter's granularity.
        assert wide < 1.5 * narrow + 10, (narrow, wide)
    with Session(engine) as session:
        page = rankpage.rank_page(session, _run(session, "wide"), SETTINGS, now, 400, 100)
    assert [r.rank for r in page.items if r.has_flight] == [r for r in range(401, 501) if r % 3]


def test_the_first_verdict_after_a_new_event_reads_as_much_at_3000_ranks_as_at_600(
    tmp_path,
) -> None:
    """During an incident every rank's received event comes in while the verdict
    is polled: each verdict after one must read the new ranks, not every diverged
    rank again (400 here against 2,000); and when an earlier event moves the
    origin, only the ranks whose relation may change (the agents said the others
    received it)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'n.db'}")
    steps = VmSteps(engine, per=100)
    migrate.upgrade(engine)
    now = time.time()
    _calm_run(engine, "narrow", 600, now)
    _calm_run(engine, "wide", 3000, now)

    def cost(name: str, rank: int, step: int, phase: str, cause: str) -> int:
        with Session(engine) as session:
            bigrun.verdict(session, _run(session, name), SETTINGS, now)
        event = _nan(rank, step, phase, cause, 3000)
        write_batch(engine, [_message(name, rank, 4, "event", event)], now)
        with Session(engine) as session:
            run = _run(session, name)
            before = steps.count
            found = bigrun.verdict(session, run, SETTINGS, now)
            spent = steps.count - before
        assert rank in found.ranks_affected
        return spent

    # (ranks 3, 6, ... had no event yet, the origin is at step 2: see _calm_run)
    for rank, step, phase, cause in [
        (3, 2, "grad", "received"),
        (6, 2, "grad", "received"),
        (9, 1, "forward", "produced"),  # the origin moves a step earlier
    ]:
        narrow = cost("narrow", rank, step, phase, cause)
        wide = cost("wide", rank, step, phase, cause)
        assert wide < 1.5 * narrow + 10, (rank, narrow, wide)


def _zero_events(received: bool) -> list[dict[str, Any]]:
    """Two ranks' first events at one update of a ZeRO optimizer: rank 1 made
    fc.weight non-finite, and rank 0 received it (``received``) or made its
    own shard's fc2.weight non-finite (order 4)."""
    messages = [_hello("zero", r, 2) for r in range(2)]
    made = _nan(1, 2, "param", "produced", 2)
    mine = _nan(0, 2, "param", "received" if received else "produced", 2)
    if not received:
        mine["event"].update(module="blocks.1.fc2.weight", order=4)
    messages += [_message("zero", r, 2, "event", e) for r, e in ((0, mine), (1, made))]
    return messages


@pytest.mark.parametrize("received", [True, False], ids=["received", "each-made-its-own"])
def test_a_big_runs_verdict_tells_a_zero_receiver_from_a_rank_that_made_its_own_shard(
    tmp_path, received: bool
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'n.db'}")
    migrate.upgrade(engine)
    now = time.time()
    write_batch(engine, _zero_events(received), now)
    with Session(engine) as session:
        run = _run(session, "zero")
        rows = store.ranks_of(session, [run.id])[run.id]
        recounted = views.verdict(session, run, rows, SETTINGS, now)
        counted = bigrun.verdict(session, run, SETTINGS, now)
    assert recounted.origin is not None
    if received:  # (rank 0 is the lower rank: first in a plain tie)
        assert recounted.origin.rank == 1 and recounted.ranks_received == [0]
        assert not recounted.simultaneous
    else:
        assert recounted.simultaneous and recounted.ranks_received == []
    assert counted.model_dump() == recounted.model_dump()
