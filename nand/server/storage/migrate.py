"""Schema migrations, run programmatically when the server starts.

A database created by one version of nand opens with the next: the server
upgrades it to the newest Alembic revision in ``nand/server/storage/migrations``.
On PostgreSQL an advisory lock makes concurrent starts of several servers
take turns.

>>> from nand.server.storage.db import make_engine
>>> engine = make_engine("sqlite:///:memory:")
>>> upgrade(engine)
>>> current_revision(engine) == head_revision()
True
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

MIGRATIONS = Path(__file__).with_name("migrations")
_LOCK_KEY = 0x6E616E64  # "nand"


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to ``revision`` (default: the newest)."""
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
        command.upgrade(alembic_config(connection), revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()
