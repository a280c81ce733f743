"""fingerprints.replica_group: HSDP ranks compared within their replica group

Revision ID: 0009
Revises: 0008

Under HSDP only the ranks that hold the same shard hold the same tensors; a
fingerprint names its group (the rank's coordinates on the sharded mesh
dimensions; "" under DDP) and the server compares within groups
(nand.server.analysis.replicas).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fingerprints") as batch_op:
        batch_op.add_column(
            sa.Column("replica_group", sa.String(length=64), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("fingerprints") as batch_op:
        batch_op.drop_column("replica_group")
