"""One writer at a time per run for the decisions that look across its ranks.

Several servers on one PostgreSQL store one run's messages at the same moment.
Most of a batch needs no coordination: the dedup keys are a primary key, a
rank's first event is kept by a conditional update, counters are added in
place. What compares ranks does: :mod:`nand.server.analysis.replicas` compares a step's
fingerprints once they are stored and :mod:`nand.server.analysis.outliers` a step's
gradient norms once every rank's are in. Were two servers each to store one
rank's half and look at the same moment, neither would see the other's
uncommitted half, and the step would never be compared (under READ COMMITTED).

So a batch *holds its runs* before those steps: it locks their ``runs`` rows
(``SELECT … FOR NO KEY UPDATE``, in id order, the order every server takes them in)
until it commits. A second server's batch of the same run waits there, then
reads what the first committed. The lock is taken after the batch's own rows
are written, so only the comparisons wait, not the inserts. On SQLite there is
one writer at a time anyway (the database lock), so nothing is done.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from nand.server.storage.models import Run
from nand.server.storage.runids import RunIds


def hold(conn: Connection, messages: list[dict[str, Any]], run_ids: RunIds) -> None:
    """Lock the rows of the runs ``messages`` went to until the transaction ends
    (PostgreSQL; on SQLite, a no-op that costs nothing per message)."""
    if conn.dialect.name == "sqlite":
        return
    ids = sorted({run_ids.of(message) for message in messages})
    if ids:
        # FOR NO KEY UPDATE: the lock an UPDATE of the row takes. Plain FOR UPDATE
        # would also wait for the key-share locks that inserting rows which refer to
        # the run (heartbeats, events) takes, and two such batches deadlock.
        statement = select(Run.id).where(Run.id.in_(ids)).order_by(Run.id)
        conn.execute(statement.with_for_update(key_share=True))
