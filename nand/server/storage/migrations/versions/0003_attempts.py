"""attempts: a run id used again is a new attempt (runs keyed by name and attempt)

Revision ID: 0003
Revises: 0002

Every existing run becomes attempt 1 of its name, live. The unique name becomes
a unique (name, attempt); ``superseded_at`` marks the attempts a newer one
replaced; ``launch`` keeps the agents' ``NAND_LAUNCH`` (see nand.server.agents.attempts).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

#: How 0001 named the unnamed UNIQUE(name): PostgreSQL's default name; on SQLite
#: the batch copy finds it through this naming convention.
PG_NAME_KEY = "runs_name_key"
SQLITE_CONVENTION = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        op.drop_constraint(PG_NAME_KEY, "runs", type_="unique")
    with op.batch_alter_table("runs", naming_convention=SQLITE_CONVENTION) as batch_op:
        if not postgres:
            batch_op.drop_constraint("uq_runs_name", type_="unique")
        batch_op.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("superseded_at", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("launch", sa.String(length=256), nullable=True))
        batch_op.create_unique_constraint("uq_runs_name_attempt", ["name", "attempt"])
        batch_op.create_index("ix_runs_name", ["name"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runs", naming_convention=SQLITE_CONVENTION) as batch_op:
        batch_op.drop_index("ix_runs_name")
        batch_op.drop_constraint("uq_runs_name_attempt", type_="unique")
        batch_op.drop_column("launch")
        batch_op.drop_column("superseded_at")
        batch_op.drop_column("attempt")
        batch_op.create_unique_constraint("uq_runs_name", ["name"])
