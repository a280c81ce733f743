"""drops: the messages each agent dropped, by reason; ranks.dropped, their sum per rank

Revision ID: 0004
Revises: 0003

Agents send their cumulative loss counts in every heartbeat (``dropped``);
``drops`` keeps each agent's largest count per reason and ``ranks.dropped``
the rank's total by reason (see nand.server.analysis.losses).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "drops",
        sa.Column("agent", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.String(length=40), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("agent", "reason"),
    )
    op.create_index("ix_drops_run_rank", "drops", ["run_id", "rank"], unique=False)
    with op.batch_alter_table("ranks") as batch_op:
        batch_op.add_column(sa.Column("dropped", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch_op:
        batch_op.drop_column("dropped")
    op.drop_index("ix_drops_run_rank", table_name="drops")
    op.drop_table("drops")
