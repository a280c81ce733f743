"""rank losses: the messages each rank's agent dropped, by reason

Revision ID: 0004
Revises: 0003

Agents report their cumulative losses (queue full, spool full, disk full...)
in every heartbeat; the rank keeps the latest, so a run with gaps says so.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ranks") as batch_op:
        batch_op.add_column(sa.Column("dropped", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch_op:
        batch_op.drop_column("dropped")
