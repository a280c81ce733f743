"""events_rank_key: a rank's events indexed by its whole logical key

Revision ID: 0005
Revises: 0004

Ingest looks up each batch's first event per rank by ``(run_id, rank, step,
micro_step, phase_rank, ord)`` (``nand.server.analysis.firsts.event_id``). With only
``(run_id, rank, step)`` beside ``(run_id, step, micro_step, phase_rank, ord)``
the planners chose the latter, which holds every rank's event at a point
that all ranks share (a NaN the all-reduce spread): the lookup grew with the
run, and ingest from new ranks slowed from ~2,900 to ~340 msg/s at 20,000
ranks. ``ix_events_rank`` becomes ``ix_events_rank_key`` over the whole key;
its prefix serves what the old index did (a rank's events by step).
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

KEY = ["run_id", "rank", "step", "micro_step", "phase_rank", "ord"]


def upgrade() -> None:
    op.create_index("ix_events_rank_key", "events", KEY, unique=False)
    op.drop_index("ix_events_rank", table_name="events")


def downgrade() -> None:
    op.create_index("ix_events_rank", "events", ["run_id", "rank", "step"], unique=False)
    op.drop_index("ix_events_rank_key", table_name="events")
