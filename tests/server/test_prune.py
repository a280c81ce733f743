"""Retention: ``nand prune --older-than`` deletes old runs and everything of theirs."""

from __future__ import annotations

import time

import httpx
from sqlalchemy import create_engine, func, insert, select, update

from nand.cli.server_args import _duration
from nand.server.__main__ import main
from nand.server.storage.models import AgentLease, EventRow, Heartbeat, Message, Run


def test_prune_deletes_runs_older_than_the_age_with_their_rows(
    server, agents, db_url, capsys
) -> None:
    for name in ("old", "new"):
        a = agents(run=name)
        a.hello()
        a.heartbeat(3)
        a.event(step=4, phase="forward", module="fc")
        a.wait_acked()
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            update(Run).where(Run.name == "old").values(last_seen=time.time() - 40 * 86400)
        )
        # A server killed 40 days ago never released its agent's lease.
        gone = {"agent": "of-a-killed-server", "server": "h tcp://h:1", "expires": 1.0}
        conn.execute(insert(AgentLease).values(**gone))
    assert main(["prune", "--older-than", "30d", "--db", db_url]) == 0
    assert "pruned 1 run(s): old" in capsys.readouterr().out
    names = [r["run"] for r in httpx.get(f"{server.http_url}/api/runs").json()]
    assert names == ["new"]
    with engine.connect() as conn:
        for table, left in ((EventRow, 1), (Heartbeat, 1), (Message, 3)):
            assert conn.scalar(select(func.count()).select_from(table)) == left
        assert conn.scalar(select(AgentLease.agent).where(AgentLease.expires < 2.0)) is None
    engine.dispose()


def test_durations() -> None:
    assert _duration("30d") == 30 * 86400
    assert _duration("12h") == 43200
    assert _duration("90") == 90
