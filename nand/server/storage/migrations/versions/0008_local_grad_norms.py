"""local_grad_norms: each DDP rank's own gradient norm per step, until compared

Revision ID: 0008
Revises: 0007

Heartbeats carry each rank's gradient norm before the all-reduce
(``local_grad_norms``); a step's rows wait here until every rank's are in,
then the server compares them and deletes them (nand.server.analysis.outliers).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "local_grad_norms",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("norm", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "step", "rank"),
    )


def downgrade() -> None:
    op.drop_table("local_grad_norms")
