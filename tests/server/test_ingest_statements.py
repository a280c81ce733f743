"""What one batch costs the database: statements that do not grow with the
batch (``nand.server.agents.writer`` on a real SQLite file), and a commander
that asks one plain query a batch when no stop is pending."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from sqlalchemy import event

from nand import wire
from nand.server.agents.orders import Commander
from nand.server.agents.writer import write_batch
from nand.server.metrics import Metrics
from nand.server.settings import Settings
from nand.server.storage.db import make_engine
from nand.server.storage.migrate import upgrade

WORLD = 8


def messages(run: str, agents: list[str], kind: str, first_step: int, n: int) -> list[dict]:
    """``n`` messages of ``kind``, the ranks in turn, as the ingest decodes them."""
    out = []
    for i in range(n):
        rank, step = i % WORLD, first_step + i // WORLD
        body: dict[str, Any] = (
            {"host": "h", "pid": 100 + rank, "world_size": WORLD, "device": "cpu"}
            if kind == "hello"
            else {"step": step, "loss": 2.0, "grad_norm": 1.0, "local_grad_norms": [[step, 1.0]]}
        )
        message = wire.agent_message(
            kind, agent=agents[rank], seq=1 + step, run=run, rank=rank, body=body
        )
        out.append(wire.decode(wire.encode(message)))
    return out


@pytest.fixture
def engine(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'batch.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def counted(engine, work) -> int:
    statements = []

    def count(*_: Any) -> None:
        statements.append(1)

    event.listen(engine, "before_cursor_execute", count)
    try:
        work()
    finally:
        event.remove(engine, "before_cursor_execute", count)
    return len(statements)


def test_a_batch_of_heartbeats_costs_the_same_statements_at_400_and_4000_messages(engine):
    """Each batch's steps cross a multiple of PRUNE_EVERY and leave rows over
    after the full multi-row statements: only the batch's size differs."""
    agents = [uuid.uuid4().hex for _ in range(WORLD)]
    write_batch(engine, messages("sizes", agents, "hello", 0, WORLD), time.time())
    small = messages("sizes", agents, "heartbeat", 250, 400)
    large = messages("sizes", agents, "heartbeat", 1000, 4000)
    cost_small = counted(engine, lambda: write_batch(engine, small, time.time()))
    cost_large = counted(engine, lambda: write_batch(engine, large, time.time()))
    assert cost_large == cost_small <= 30, (cost_small, cost_large)


def test_heartbeats_of_many_ranks_cost_a_statement_per_500_ranks_not_one_per_rank(engine):
    """A 100,000-rank job's batch holds heartbeats of 2,000 ranks, each one's
    agent's first in the batch: telling them from resends (each agent's highest
    stored seq) took a statement per agent (nand.server.agents.seqs)."""

    def beats(agents: list[str], seq: int) -> list[dict]:
        made = [
            wire.agent_message("heartbeat", agent=a, seq=seq, run="many", rank=r, body={"step": 1})
            for r, a in enumerate(agents)
        ]
        return [wire.decode(wire.encode(m)) for m in made]

    def cost(ranks: int) -> int:
        agents = [uuid.uuid4().hex for _ in range(ranks)]
        write_batch(engine, beats(agents, 1), time.time())  # (each agent has a seq stored)
        return counted(engine, lambda: write_batch(engine, beats(agents, 2), time.time()))

    few, many = cost(200), cost(2_000)
    assert many - few <= 2_000 // 500, (few, many)


def test_with_no_stop_pending_the_commander_asks_one_query_a_batch(engine):
    agents = [uuid.uuid4().hex for _ in range(WORLD)]
    batch = messages("quiet", agents, "hello", 0, WORLD)
    batch += messages("quiet", agents, "heartbeat", 1, 400)
    write_batch(engine, batch, time.time())
    sent: list[tuple[bytes, dict]] = []
    commander = Commander(engine, Settings(), Metrics(), lambda i, m: sent.append((i, m)))
    accepted = [(b"conn-%d" % m["rank"], m) for m in batch]
    commander.seen(accepted, time.time())
    assert counted(engine, lambda: commander.after_batch(accepted)) == 1
    assert sent == []
