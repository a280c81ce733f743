"""Each rank's logically first event, cached on its row.

The verdict never scans events: each rank row holds the id and logical key
``(step, micro_step, phase, order)`` of its first event, replaced only by an
event with a smaller key (one conditional UPDATE per batch), so batches that
arrive out of order still leave the true first in place.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, bindparam, or_, select, tuple_
from sqlalchemy import update as sql_update

from nand.server.storage.models import EventRow, Rank


def event_id(conn: Connection, row: dict[str, Any]) -> int:
    """The id of a just-inserted event row, found by its rank and logical key."""
    statement = (
        select(EventRow.id)
        .where(
            EventRow.run_id == row["run_id"],
            EventRow.rank == row["rank"],
            EventRow.step == row["step"],
            EventRow.micro_step == row["micro_step"],
            EventRow.phase_rank == row["phase_rank"],
            EventRow.ord == row["ord"],
        )
        .order_by(EventRow.id)
        .limit(1)
    )
    return int(conn.execute(statement).scalar_one())


def update_firsts(
    conn: Connection, firsts: dict[int, tuple[tuple[int, int, int, int], int]]
) -> None:
    """Keep each rank's logically first event: replace only by a smaller key."""
    if not firsts:
        return
    new_key = tuple_(
        bindparam("k_step"), bindparam("k_micro"), bindparam("k_phase"), bindparam("k_ord")
    )
    old_key = tuple_(
        Rank.first_step, Rank.first_micro_step, Rank.first_phase_rank, Rank.first_order
    )
    statement = (
        sql_update(Rank)
        .where(
            and_(Rank.id == bindparam("rid"), or_(Rank.first_event_id.is_(None), old_key > new_key))
        )
        .values(
            first_event_id=bindparam("eid"),
            first_step=bindparam("k_step"),
            first_micro_step=bindparam("k_micro"),
            first_phase_rank=bindparam("k_phase"),
            first_order=bindparam("k_ord"),
        )
    )
    params = [
        {"rid": rid, "eid": eid, "k_step": k[0], "k_micro": k[1], "k_phase": k[2], "k_ord": k[3]}
        for rid, (k, eid) in firsts.items()
    ]
    conn.execute(statement, params)
