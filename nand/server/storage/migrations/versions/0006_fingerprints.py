"""fingerprints: the DDP replicas' parameter fingerprints, and a run's mismatch

Revision ID: 0006
Revises: 0005

Every ``NAND_FINGERPRINT_STEPS`` steps each DDP rank sends one integer per
parameter (``nand.agent.step.fingerprint``); ``fingerprints`` keeps the
latest steps of each run, and ``runs.replica_*`` what the comparison found
(see nand.server.analysis.replicas).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fingerprints",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("names", sa.JSON(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "step", "rank"),
    )
    with op.batch_alter_table("runs") as batch_op:
        batch_op.add_column(sa.Column("replica_step", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("replica_good_step", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("replica_ranks", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("replica_params", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch_op:
        for column in ("replica_params", "replica_ranks", "replica_good_step", "replica_step"):
            batch_op.drop_column(column)
    op.drop_table("fingerprints")
