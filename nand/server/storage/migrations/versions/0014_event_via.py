"""events.via: the collective a received value came through

Revision ID: 0014
Revises: 0013

Tensor, pipeline and ZeRO parallelism hand values between ranks through
collectives other than DDP's all-reduce and FSDP's all-gather; the agent that
received a value names the one it came through (``nand.events.Event.via``)
and the verdict says it in those words.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("events") as batch_op:
        batch_op.add_column(
            sa.Column("via", sa.String(length=80), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("events") as batch_op:
        batch_op.drop_column("via")
