"""warnings: early warnings of a blow-up, per rank and step

Revision ID: 0007
Revises: 0006

An agent sends a ``warning`` when the loss spikes, the gradient norm grows by
an order of magnitude or an activation nears its dtype's limit
(``nand.agent.step.blowup``); each is a row here, never an event (see
nand.server.analysis.alerts).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "warnings",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("module", sa.String(length=512), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("reference", sa.Float(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_warnings_run_step", "warnings", ["run_id", "step"], unique=False)
    with op.batch_alter_table("runs") as batch_op:
        batch_op.add_column(
            sa.Column("warning_count", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch_op:
        batch_op.drop_column("warning_count")
    op.drop_index("ix_warnings_run_step", table_name="warnings")
    op.drop_table("warnings")
