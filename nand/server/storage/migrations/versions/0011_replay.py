"""events.op, source, reproduced, replay: what the replay of a bad step found

Revision ID: 0011
Revises: 0010

The agent runs a new incident's step again (nand.agent.rerun) and names the
aten op that made the value, the user's source line, and whether the value
came back (null: not replayed); ``replay`` says what was replayed or why not.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("events") as batch_op:
        batch_op.add_column(
            sa.Column("op", sa.String(length=128), nullable=False, server_default="")
        )
        batch_op.add_column(
            sa.Column("source", sa.String(length=1024), nullable=False, server_default="")
        )
        batch_op.add_column(sa.Column("reproduced", sa.Boolean(), nullable=True))
        batch_op.add_column(
            sa.Column("replay", sa.String(length=300), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("events") as batch_op:
        for column in ("replay", "reproduced", "source", "op"):
            batch_op.drop_column(column)
