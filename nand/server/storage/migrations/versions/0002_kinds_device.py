"""events.kinds (value kinds in words), ranks.device, flights.mag_min/mag_max

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("events") as batch_op:
        batch_op.add_column(
            sa.Column("kinds", sa.String(length=80), nullable=False, server_default="")
        )
    with op.batch_alter_table("ranks") as batch_op:
        batch_op.add_column(
            sa.Column("device", sa.String(length=64), nullable=False, server_default="")
        )
    with op.batch_alter_table("flights") as batch_op:
        batch_op.add_column(sa.Column("mag_min", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("mag_max", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("flights") as batch_op:
        batch_op.drop_column("mag_max")
        batch_op.drop_column("mag_min")
    with op.batch_alter_table("ranks") as batch_op:
        batch_op.drop_column("device")
    with op.batch_alter_table("events") as batch_op:
        batch_op.drop_column("kinds")
