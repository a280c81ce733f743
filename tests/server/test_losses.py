"""Messages the agents dropped: kept per agent as the largest cumulative count,
summed per rank, shown in the rank view, the run, the verdict and /metrics;
malformed counts refused on the wire and counted."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from nand.events import DROP_REASONS
from tests.server.helpers import eventually

ROOT = Path(__file__).resolve().parents[2]


def _ranks(server, run: str) -> dict[int, dict]:
    rows = httpx.get(f"{server.http_url}/api/runs/{run}/ranks").json()["items"]
    return {row["rank"]: row for row in rows}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_heartbeats_repeat_cumulative_counts_and_the_largest_is_kept_never_the_sum(
    server, agents
) -> None:
    a = agents(run="gaps", rank=3, world_size=4)
    a.hello()
    a.heartbeat(10, dropped={"spool_full": 600})
    a.heartbeat(20, dropped={"spool_full": 1000, "rejected": 204})
    a.heartbeat(15, dropped={"spool_full": 800})  # a late one (a replayed spool)
    a.heartbeat(30, dropped={"spool_full": 1000, "rejected": 204})  # the same again
    a.wait_acked()

    rank = _ranks(server, "gaps")[3]
    assert rank["dropped"] == {"spool_full": 1000, "rejected": 204}
    assert rank["messages_dropped"] == 1204


def test_a_rank_with_several_agents_sums_them_and_the_run_says_it_has_gaps(server, agents) -> None:
    parent = agents(run="two-agents", rank=1, world_size=2)
    worker = agents(run="two-agents", rank=1, world_size=2)  # a forked child: its own count
    quiet = agents(run="two-agents", rank=0, world_size=2)
    for agent in (parent, worker, quiet):
        agent.hello()
    parent.heartbeat(5, dropped={"queue_full": 7})
    worker.heartbeat(5, dropped={"queue_full": 3, "spool_full": 2})
    quiet.heartbeat(5)
    for agent in (parent, worker, quiet):
        agent.wait_acked()

    ranks = _ranks(server, "two-agents")
    assert ranks[1]["dropped"] == {"queue_full": 10, "spool_full": 2}
    assert (ranks[0]["dropped"], ranks[0]["messages_dropped"]) == ({}, 0)
    run = httpx.get(f"{server.http_url}/api/runs/two-agents").json()
    assert run["messages_dropped"] == 12 and run["dropped"] == {"queue_full": 10, "spool_full": 2}
    assert run["gaps"] == [
        {"rank": 1, "messages_dropped": 12, "dropped": {"queue_full": 10, "spool_full": 2}}
    ]
    verdict = httpx.get(f"{server.http_url}/api/runs/two-agents/verdict").json()
    assert verdict["ranks_with_gaps"] == [1] and verdict["messages_dropped"] == 12
    assert verdict["gaps_summary"] == (
        "Rank 1 dropped 12 messages before the server had them (queue_full 10, spool_full 2): "
        "its record here has gaps."
    )
    assert "dropped" not in verdict["summary"]  # the verdict's reasoning stays as it was
    listed = httpx.get(f"{server.http_url}/api/runs").json()
    assert next(r for r in listed if r["run"] == "two-agents")["messages_dropped"] == 12


def test_a_run_without_losses_says_nothing_about_gaps(server, agents) -> None:
    a = agents(run="whole")
    a.hello()
    a.heartbeat(3, dropped={})
    a.heartbeat(4)
    a.wait_acked()
    verdict = httpx.get(f"{server.http_url}/api/runs/whole/verdict").json()
    assert (verdict["messages_dropped"], verdict["ranks_with_gaps"]) == (0, [])
    assert verdict["gaps_summary"] == ""
    assert httpx.get(f"{server.http_url}/api/runs/whole").json()["gaps"] == []


def test_metrics_count_losses_by_reason_with_unknown_reasons_as_other(server, agents) -> None:
    a = agents(run="m1", rank=0)
    b = agents(run="m2", rank=0)
    a.hello(), b.hello()
    a.heartbeat(1, dropped={"spool_full": 1000, "queue_full": 5})
    b.heartbeat(1, dropped={"spool_full": 24, "from_a_newer_agent": 2})
    a.wait_acked(), b.wait_acked()

    text = httpx.get(f"{server.http_url}/metrics").text
    dropped = "nand_agent_messages_dropped"
    assert _metric(text, f'{dropped}{{reason="spool_full"}}') == 1024
    assert _metric(text, f'{dropped}{{reason="queue_full"}}') == 5
    assert _metric(text, f'{dropped}{{reason="other"}}') == 2
    assert _metric(text, f'{dropped}{{reason="rejected"}}') == 0  # every reason shows
    assert "from_a_newer_agent" not in text  # labels stay bounded
    assert _metric(text, "nand_runs_with_gaps") == 2
    # The REST view shows the newer reason as it was sent.
    assert _ranks(server, "m2")[0]["dropped"] == {"spool_full": 24, "from_a_newer_agent": 2}


@pytest.mark.parametrize(
    "dropped",
    [
        {"spool_full": -1},
        {"spool_full": 1.5},
        {"spool_full": True},
        {"spool_full": "12"},
        {"Spool Full": 1},
        {"x" * 41: 1},
        {f"r{i}": 1 for i in range(33)},
        ["spool_full", 1],
    ],
    ids=["negative", "float", "bool", "text", "not-an-identifier", "long", "too-many", "list"],
)
def test_malformed_counts_are_refused_as_bad_field_and_counted(server, agents, dropped) -> None:
    a = agents(run="bad-drops")
    a.hello()
    a.wait_acked()
    seq = a.heartbeat(1, dropped=dropped)
    a.pump(0.3)
    assert seq not in a.acked
    text = httpx.get(f"{server.http_url}/metrics").text
    assert _metric(text, 'nand_messages_rejected_total{reason="bad_field"}') == 1
    assert _ranks(server, "bad-drops")[0]["dropped"] == {}


def test_an_earlier_attempt_keeps_its_own_losses(server, agents) -> None:
    first = agents(run="again", rank=0)
    first.hello(launch="launch-1")
    first.heartbeat(9, dropped={"spool_full": 50})
    first.wait_acked()
    second = agents(run="again", rank=0)
    second.hello(launch="launch-2")
    second.heartbeat(2)
    second.wait_acked()
    eventually(lambda: _ranks(server, "again")[0]["step"] == 2)
    assert _ranks(server, "again")[0]["dropped"] == {}
    old = httpx.get(f"{server.http_url}/api/runs/again/ranks?attempt=1").json()["items"]
    assert old[0]["dropped"] == {"spool_full": 50}


def test_the_vocabulary_has_every_reason_the_agent_transport_counts() -> None:
    transport = ROOT / "nand" / "agent" / "transport"
    counted = set()
    for path in transport.glob("*.py"):
        counted |= set(re.findall(r"\b(?:count_)?drop\(\s*\"([a-z_]+)\"", path.read_text()))
    assert counted, "no reasons found: the pattern no longer matches the transport"
    assert counted <= set(DROP_REASONS), counted - set(DROP_REASONS)


def _beat(agent: str, seq: int, step: int, dropped: dict[str, int]) -> dict:
    from nand import wire

    body = {"step": step, "dropped": dropped}
    message = wire.agent_message("heartbeat", agent=agent, seq=seq, run="memo", rank=0, body=body)
    return wire.decode(wire.encode(message))


def test_heartbeats_repeating_committed_counts_write_no_drop_rows(sqlite_url, monkeypatch) -> None:
    """The ingest loop remembers the counts it committed (losses.Committed): a
    batch repeating them runs no statement on drops; a larger count, a new
    reason or the periodic refresh writes again, and the sums stay right."""
    import time

    from sqlalchemy import event

    from nand.server.agents.writer import write_batch
    from nand.server.analysis import losses
    from nand.server.storage.db import make_engine
    from nand.server.storage.migrate import upgrade
    from nand.server.storage.models import Rank

    engine = make_engine(sqlite_url)
    upgrade(engine)
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    committed = losses.Committed()

    def write(seq: int, dropped: dict[str, int]) -> int:
        statements.clear()
        write_batch(engine, [_beat("a1", seq, seq, dropped)], time.time(), drops=committed)
        return sum("drops" in s for s in statements)

    def dropped() -> dict:
        with engine.connect() as conn:
            return conn.execute(Rank.__table__.select()).one()._mapping["dropped"]

    assert write(1, {"queue_full": 3}) > 0
    assert write(2, {"queue_full": 3}) == 0  # the same count: nothing written
    assert write(3, {"queue_full": 2}) == 0  # a late, smaller one: nothing either
    assert dropped() == {"queue_full": 3}
    assert write(4, {"queue_full": 5, "spool_full": 1}) > 0
    assert dropped() == {"queue_full": 5, "spool_full": 1}
    monkeypatch.setattr(losses, "REFRESH_S", 0.0)  # past the refresh: written again
    write(5, {"queue_full": 5, "spool_full": 1})
    assert write(6, {"queue_full": 5, "spool_full": 1}) > 0
    assert dropped() == {"queue_full": 5, "spool_full": 1}
    engine.dispose()
