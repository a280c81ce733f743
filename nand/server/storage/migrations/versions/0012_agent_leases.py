"""agent_leases: which server speaks for an agent id, and until when

Revision ID: 0012
Revises: 0011

Several servers share one database; an agent id is bound to the one whose
connection it speaks on. The binding is a lease here (nand.server.agents.leases),
renewed while the agent is heard, so a second server refuses an agent id
another live server holds and takes it over once that lease has run out.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agent_leases",
        sa.Column("agent", sa.String(length=128), nullable=False),
        sa.Column("server", sa.String(length=300), nullable=False),
        sa.Column("expires", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("agent"),
    )
    op.create_index("ix_agent_leases_server", "agent_leases", ["server"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_agent_leases_server", table_name="agent_leases")
    op.drop_table("agent_leases")
