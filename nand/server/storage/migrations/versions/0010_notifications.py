"""notifications: the outbox of state changes to POST to NAND_NOTIFY_URL

Revision ID: 0010
Revises: 0009

One row per (run attempt, state, target URL), kept until delivered, so a
notification survives a server restart and is sent once (nand.server.notify.notifier).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "notifications",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=64), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_try", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.Column("last_error", sa.String(length=500), nullable=False, server_default=""),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "state", "target", name="uq_notifications_run_state_target"),
    )
    op.create_index(
        "ix_notifications_due", "notifications", ["delivered_at", "next_try"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_notifications_due", table_name="notifications")
    op.drop_table("notifications")
