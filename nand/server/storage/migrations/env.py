"""Alembic environment: always run online, on the connection nand passes in."""

from __future__ import annotations

from alembic import context

from nand.server.storage.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("nand migrations run through nand.server.storage.migrate.upgrade()")
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
