"""Fair under many clients and many ranks (issue 20): event streams share one
database poll, the first-event lookup at ingest uses the rank's own index, and
``/ranks`` comes a page at a time with every rank exactly once."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from sqlalchemy import event

from nand import wire
from nand.server.agents.writer import write_batch
from nand.server.embedded import EmbeddedServer
from nand.server.http.hub import Subscriber, Update
from tests.server.helpers import eventually

RECEIVED = {
    "step": 9,
    "micro_step": 0,
    "phase": "grad",
    "module": "fc.weight",
    "module_type": "Linear",
    "order": 3,
    "cause": "received",
    "nan": 1,
}
HELLO = {"world_size": 64, "host": "node-1", "pid": 42}
BYE = {"step": 3, "reason": "finished"}


def _messages(run: str, ranks: range, **event_fields: object) -> list[dict]:
    body = {"event": {**RECEIVED, **event_fields}, "flight": None}
    return [
        wire.decode(
            wire.encode(
                wire.agent_message("event", agent=f"{run}-{r}", seq=1, run=run, rank=r, body=body)
            )
        )
        for r in ranks
    ]


def _fill(server: EmbeddedServer, run: str, ranks: range, **event_fields: object) -> None:
    """Store one first event from each rank, straight through the writer."""
    engine = server.app.state.nand.engine
    messages = _messages(run, ranks, **event_fields)
    for start in range(0, len(messages), 500):
        write_batch(engine, messages[start : start + 500], time.time())


@contextmanager
def _streams(url: str, count: int) -> Iterator[list[int]]:
    """``count`` open stream connections (half of them ``?run=``); bytes read by each."""
    read = [0] * count
    stop = threading.Event()
    opened = threading.Semaphore(0)

    def follow(i: int) -> None:
        path = "/api/stream?run=busy" if i % 2 else "/api/stream"
        with httpx.stream("GET", f"{url}{path}", timeout=30) as response:
            opened.release()
            for chunk in response.iter_raw():
                read[i] += len(chunk)
                if stop.is_set():
                    return

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert opened.acquire(timeout=30)
    try:
        yield read
    finally:
        stop.set()


def _counting_polls(server: EmbeddedServer) -> list[float]:
    """The times of the stream's poll queries (``runs.updated_at >= ...``) on the server."""
    polls: list[float] = []

    def seen(_conn, _cursor, statement: str, *_args: object) -> None:
        if "FROM runs" in statement and "runs.updated_at >=" in statement:
            polls.append(time.monotonic())

    event.listen(server.app.state.nand.engine, "before_cursor_execute", seen)
    return polls


def test_forty_stream_clients_cost_one_database_poll_per_interval(server, agents) -> None:
    """Counted against the hub's own turns (``nand_stream_polls``, one a
    ``poll_s``), not the clock: one query a turn, not one a client (40)."""
    busy = agents(run="busy")
    busy.heartbeat(1)
    busy.wait_acked()
    polls = _counting_polls(server)
    hub = server.app.state.nand.hub
    with _streams(server.http_url, 40) as read:
        eventually(lambda: all(n > 0 for n in read), timeout=30)  # each has its summaries
        turns, first = _stream_turns(server), len(polls)
        eventually(lambda: _stream_turns(server) >= turns + 6, timeout=60)
        turns, during = _stream_turns(server) - turns, len(polls) - first
        busy.heartbeat(2)
        busy.wait_acked()
    # (a turn queries, then counts itself: either count may be one turn ahead)
    assert abs(during - turns) <= 1, (during, turns)
    eventually(lambda: not hub.subscribers, timeout=10)  # disconnected streams are gone
    # and nobody polls for no one: the poller ends with its last subscriber
    eventually(lambda: hub._task is None or hub._task.done(), timeout=10)


def _stream_turns(server: EmbeddedServer) -> float:
    """The server's count of its stream poller's turns (/metrics)."""
    for line in httpx.get(f"{server.http_url}/metrics").text.splitlines():
        if line.startswith("nand_stream_polls_total "):
            return float(line.split()[1])
    raise AssertionError("nand_stream_polls_total not in /metrics")


def test_a_slow_subscriber_keeps_only_the_latest_summary_of_each_run() -> None:
    slow = Subscriber(None)
    for i in range(10_000):
        slow.offer([Update("a", f"k{i}", f"body{i}"), Update(f"run-{i % 3}", f"k{i}", "x")])
    taken = slow.take()
    assert len(taken) == 4  # a, run-0, run-1, run-2: one entry per run, however many states
    assert next(u.body for u in taken if u.run == "a") == "body9999"
    slow.offer([Update("a", "k9999", "body9999")])  # what it already has: nothing to send
    assert slow.take() == []


def test_the_first_event_lookup_at_ingest_uses_the_rank_key_index(sqlite_url) -> None:
    from nand.server.storage.db import make_engine
    from nand.server.storage.migrate import upgrade

    engine = make_engine(sqlite_url)
    upgrade(engine)
    lookups: list[tuple[str, tuple]] = []

    def seen(_conn, _cursor, statement: str, parameters: tuple, *_args: object) -> None:
        if statement.lstrip().startswith("SELECT events.id") and "events.ord =" in statement:
            lookups.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", seen)
    write_batch(engine, _messages("wide", range(50)), time.time())
    assert lookups, "ingest no longer looks the first event up: update this test"
    statement, parameters = lookups[-1]
    with engine.connect() as conn:
        plan = " ".join(
            str(row[-1])
            for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
        )
    assert "ix_events_rank_key" in plan, plan
    engine.dispose()


def test_pages_of_ranks_list_every_rank_exactly_once(server) -> None:
    _fill(server, "wide", range(1, 1200))
    _fill(server, "wide", range(0, 1), step=8, cause="produced", phase="forward")  # the origin
    url = f"{server.http_url}/api/runs/wide/ranks"
    first = httpx.get(url).json()
    assert len(first["items"]) == first["limit"] == 500
    assert first["total"] == 1200 and first["states"] == {"diverged": 1200}
    seen: list[int] = []
    after = None
    pages = 0
    while True:
        params = {"limit": 250} if after is None else {"limit": 250, "after": after}
        page = httpx.get(url, params=params).json()
        seen += [r["rank"] for r in page["items"]]
        pages += 1
        if pages == 2:
            _fill(server, "wide", range(5000, 5003))  # ranks that join while a client pages
        after = page["next_after"]
        if after is None:
            break
    assert seen == sorted(set(seen)) and set(range(1200)) <= set(seen), "a rank twice or missed"
    assert pages == 5 and page["total"] == 1203
    # Relations are the run's, whichever page a rank is on: the origin is on the first.
    relations = {r["rank"]: r["relation"] for r in first["items"]}
    assert relations[0] == "origin" and relations[499] == "received"
    last = httpx.get(url, params={"after": 1100}).json()["items"]
    assert {r["relation"] for r in last} == {"received"}


def test_the_origin_is_simultaneous_on_every_page_when_ranks_went_together(server) -> None:
    _fill(server, "same", range(0, 700), cause="produced", phase="forward", module="fc")
    url = f"{server.http_url}/api/runs/same/ranks"
    pages = [httpx.get(url).json(), httpx.get(url, params={"after": 499}).json()]
    assert {r["relation"] for p in pages for r in p["items"]} == {"simultaneous"}


def test_a_big_run_is_summarised_as_the_small_path_does(server) -> None:
    from sqlalchemy.orm import Session

    from nand.server.analysis import rankpage, views
    from nand.server.storage import store

    _fill(server, "mixed", range(1, 40))
    _fill(server, "mixed", range(0, 1), step=8, cause="produced", phase="forward")
    _fill(server, "mixed", range(40, 41), step=12, cause="produced", phase="backward")
    _fill(server, "together", range(0, 30), cause="produced", phase="forward", module="fc")
    state = server.app.state.nand
    with Session(state.engine) as session:
        for name in ("mixed", "together"):
            run = store.run_by_name(session, name)
            assert run is not None
            ranks = store.ranks_of(session, [run.id])[run.id]
            full = views.run_summary(run, ranks, state.settings, 100.0)
            light = rankpage.run_summary(session, run, state.settings, 100.0)
            assert light == full, name


def test_a_page_of_plain_rows_is_what_the_orm_rows_give(server) -> None:
    """``/ranks`` reads plain tuples named by the columns (rankpage._page_rows): every
    field of a page, first events with NaN and infinite values, a rank that said bye
    and one that reported losses, equals the statuses built from the ORM objects."""
    from sqlalchemy.orm import Session

    from nand.server.analysis import rankpage, views
    from nand.server.storage import store

    _fill(server, "plain", range(1, 40))
    _fill(server, "plain", range(0, 1), step=8, cause="produced", phase="forward", min=-math.inf)
    _fill(server, "plain", range(40, 41), step=8, phase="forward", max=math.inf, shape=[2, 3])
    beat = {"step": 3, "loss": 1.5, "dropped": {"spool_full": 7}}
    said = [("hello", HELLO), ("heartbeat", beat), ("bye", BYE)]
    who = {"agent": "plain-50", "run": "plain", "rank": 50}
    messages = [wire.agent_message(k, seq=i, **who, body=b) for i, (k, b) in enumerate(said, 1)]
    engine = server.app.state.nand.engine
    write_batch(engine, [wire.decode(wire.encode(m)) for m in messages], time.time())
    state = server.app.state.nand
    with Session(state.engine) as session:
        run = store.run_by_name(session, "plain")
        assert run is not None
        page = rankpage.rank_page(session, run, state.settings, 100.0, None, 500)
        rows = store.ranks_of(session, [run.id])[run.id]
        firsts = {event.rank for _, event in rows if event is not None}
        relations = rankpage._relations  # (the page's relations, as the page finds them)
        settings = state.settings.for_world(run.world_size)
        full = views.rank_statuses(
            run, rows, settings, 100.0, set(), lambda events: relations(session, run.id, events)
        )
    assert page.items == full and len(full) == 42 and len(firsts) == 41
    by_rank = {item.rank: item for item in page.items}
    assert by_rank[0].first_event is not None and by_rank[0].first_event.min is None
    assert by_rank[50].messages_dropped == 7 and by_rank[50].bye_reason == "finished"
