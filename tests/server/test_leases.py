"""Agent id leases (nand.server.agents.leases) through Admission, on a real SQLite file."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import create_engine, event

from nand import wire
from nand.server.agents.admission import Admission
from nand.server.agents.leases import Leases
from nand.server.agents.writer import write_batch
from nand.server.storage.db import make_engine
from nand.server.storage.migrate import upgrade


def message(agent: str, seq: int = 1) -> dict:
    return {"agent": agent, "seq": seq, "run": "r", "rank": 0, "kind": "heartbeat", "body": {}}


def admission(url: str, server: str, lease_s: float = 15.0) -> Admission:
    engine = make_engine(url)
    leases = Leases(engine, lease_s, server)
    return Admission(engine, None, lambda _ident, _agent: True, 100, leases)


def test_a_second_server_refuses_an_agent_the_first_holds_and_takes_it_once_released(
    sqlite_url,
) -> None:
    upgrade(make_engine(sqlite_url))
    a, b = admission(sqlite_url, "host-a tcp://a:1"), admission(sqlite_url, "host-b tcp://b:1")
    assert a.refusal(b"conn-a", message("x")) is None
    assert a.leased([(b"conn-a", message("x"))]) == ([(b"conn-a", message("x"))], [])
    assert b.refusal(b"conn-b", message("x", 2)) is None  # b alone would accept it
    kept, refused = b.leased([(b"conn-b", message("x", 2))])
    assert kept == [] and refused == [(b"conn-b", message("x", 2))]
    a.leases.release_all()
    assert b.leased([(b"conn-b", message("x", 2))]) == ([(b"conn-b", message("x", 2))], [])


def test_with_the_lease_table_unreachable_messages_are_deferred_not_refused(tmp_path) -> None:
    """No ``agent_leases`` table (the database is away, or not upgraded): the
    messages are neither accepted nor counted as refused; the agents resend."""
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    gate = admission(url, "host-a tcp://a:1")
    batch = [(b"conn", message("y"))]
    assert gate.refusal(b"conn", message("y")) is None
    assert gate.leased(batch) == ([], [])


def test_a_batch_touches_its_runs_in_id_order_the_order_every_server_locks_them_in(
    tmp_path,
) -> None:
    """Two servers whose batches update the same runs in different orders deadlock
    on PostgreSQL; updating in run id order (as ``runlock`` locks) cannot."""
    engine = create_engine(f"sqlite:///{tmp_path / 'order.db'}")
    upgrade(engine)

    def hello(run: str, seq: int = 1) -> dict[str, Any]:
        body = {"world_size": 1, "host": "node0", "pid": 1}
        message = wire.agent_message("hello", agent=run, seq=seq, run=run, rank=0, body=body)
        return wire.decode(wire.encode(message))

    write_batch(engine, [hello("first"), hello("second")], time.time())  # ids 1, 2
    touched: list[list[int]] = []

    @event.listens_for(engine, "before_cursor_execute")
    def seen(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.startswith("UPDATE runs") and executemany:
            touched.append([row[-1] for row in parameters])

    write_batch(engine, [hello("second", seq=2), hello("first", seq=2)], time.time())
    assert touched and all(ids == sorted(ids) for ids in touched), touched


def lease_updates(engine) -> list[int]:
    """How many agents each ``UPDATE agent_leases`` names, as the engine runs them."""
    counted: list[int] = []

    @event.listens_for(engine, "before_cursor_execute")
    def seen(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.startswith("UPDATE agent_leases"):
            counted.append(len(parameters) - 2)  # (the agents, then server and expiry)

    return counted


def test_a_renewal_is_written_a_chunk_at_a_time_between_batches_and_only_what_changed(
    sqlite_url,
) -> None:
    """Renewing every lease at once held the ingest loop 0.4-0.6 s at 20,000
    agents every 5 s, which an event arriving then waited out: each call now
    writes about ``budget_s`` of the plan, and a lease already written to the
    expiry its agent's last message gives is not written again."""
    engine = make_engine(sqlite_url)
    upgrade(engine)
    leases = Leases(engine, 15.0, "host-a tcp://a:1")
    agents = {f"agent-{i:04}" for i in range(1_200)}
    assert leases.claim(agents, now=100.0) == set()
    leases.heard(agents, now=101.0)
    updates = lease_updates(engine)
    calls = 0
    while calls == 0 or leases._due:
        leases.renew_if_due(now=106.0, budget_s=0.0)  # one chunk per call
        calls += 1
    assert calls == 3 and sorted(updates) == [200, 500, 500]
    assert set(leases.held.values()) == {102.5 + 15.0}  # heard at 101, to the 2.5 s step
    leases.renew_if_due(now=112.0)  # nothing heard since: nothing to write
    assert len(updates) == 3 and leases._due == []
    leases.heard({"agent-0007"}, now=113.0)
    leases.renew_if_due(now=118.0)
    assert updates[3:] == [1] and leases.held["agent-0007"] == 115.0 + 15.0


def test_a_lease_claimed_on_a_message_is_not_written_again_by_the_next_renewal(
    sqlite_url,
) -> None:
    """Above about 30,000 ranks an agent's heartbeats are further apart than the
    lease, so each one claims it again: the claim writes the expiry the renewal
    would, and the renewal leaves it."""
    engine = make_engine(sqlite_url)
    upgrade(engine)
    leases = Leases(engine, 15.0, "host-a tcp://a:1")
    assert leases.claim({"agent-1", "agent-2"}, now=101.0) == set()
    leases.heard({"agent-1", "agent-2"}, now=101.0)
    updates = lease_updates(engine)
    leases.renew_if_due(now=106.0)
    assert updates == [] and leases.held == {"agent-1": 117.5, "agent-2": 117.5}
