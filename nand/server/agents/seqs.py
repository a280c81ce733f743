"""The highest stored ``seq`` of many agents in a few statements.

The writer tells a new message from a resend by its agent's highest stored
sequence number (``writer._claim``). One statement per agent was a third of
a batch's time when every heartbeat came from another rank (a 100,000-rank
job: 2,000 ranks a batch), nearly all of it the statement's round through
SQLAlchemy rather than the index probe. So the probes go up to
:data:`~nand.server.storage.db.PER_STATEMENT` (500) to a statement, each a
scalar subquery that is one seek of the ``messages`` primary key ``(agent,
seq)`` on SQLite and PostgreSQL alike (a ``GROUP BY agent`` would read every
message an agent ever sent):

    SELECT (SELECT max(seq) FROM messages WHERE agent = :a0),
           (SELECT max(seq) FROM messages WHERE agent = :a1), ...

>>> from nand.server.storage.db import make_engine
>>> from nand.server.storage.migrate import upgrade
>>> engine = make_engine("sqlite:///:memory:"); upgrade(engine)
>>> with engine.connect() as conn:
...     highest_seqs(conn, ["nobody"])
{}
"""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Connection, TextClause, text

from nand.server.storage.db import chunks


def highest_seqs(conn: Connection, agents: list[str]) -> dict[str, int]:
    """Each agent's highest stored ``seq``; agents with none stored are left out."""
    found: dict[str, int] = {}
    for chunk in chunks(agents):
        params = {f"a{i}": agent for i, agent in enumerate(chunk)}
        row = conn.execute(_statement(len(chunk)), params).one()
        found.update((agent, seq) for agent, seq in zip(chunk, row, strict=True) if seq is not None)
    return found


@lru_cache(maxsize=8)  # (full chunks share one; the last of a batch has its own size)
def _statement(count: int) -> TextClause:
    probe = "(SELECT max(seq) FROM messages WHERE agent = :a{})"
    return text("SELECT " + ", ".join(probe.format(i) for i in range(count)))
