"""Engine creation: SQLite (a file, WAL) or PostgreSQL, from one SQLAlchemy URL.

SQLite runs in WAL mode with ``synchronous=NORMAL``: a commit survives the
process being killed (``kill -9``), though not a power cut, and readers never
block the ingest writer. The WAL is copied back into the database file (a
checkpoint, with an fsync) once it holds :data:`CHECKPOINT_PAGES` pages, not
SQLite's 1,000: a batch of heartbeats of 1,000 ranks spread over a
100,000-rank run dirties more than that, so every batch paid a checkpoint
(``benchmarks/heartbeat_batch.py``: 20-30% of such a batch). The file it
leaves is cut back to :data:`WAL_LIMIT_BYTES`.

>>> engine = make_engine("sqlite:///:memory:")
>>> engine.dialect.name
'sqlite'
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url

#: Values bound in one statement (an ``IN`` list, rows of an insert) at most:
#: well under SQLite's limit of bound parameters (999 in older builds).
PER_STATEMENT = 500

#: WAL pages (4 KiB) between checkpoints: about 40 MB.
CHECKPOINT_PAGES = 10_000
#: Size the WAL file is truncated to after a checkpoint.
WAL_LIMIT_BYTES = 64 * 1024 * 1024


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = (
            create_engine(
                url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=8
            )
            if parsed.database not in (None, "", ":memory:")
            else create_engine(url)
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute(f"PRAGMA wal_autocheckpoint={CHECKPOINT_PAGES}")
    cursor.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
    cursor.close()


def dialect_insert(conn: Connection, table: Any) -> postgresql.Insert | sqlite.Insert:
    """``INSERT`` in the connection's dialect, which has ``ON CONFLICT`` (both
    SQLite and PostgreSQL spell it the same way in SQLAlchemy)."""
    return (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(table)


def insert_ignoring_conflicts(conn: Connection, table: Any) -> Any:
    """``INSERT … ON CONFLICT DO NOTHING`` in the connection's dialect."""
    return dialect_insert(conn, table).on_conflict_do_nothing()


T = TypeVar("T")


def chunks(items: Sequence[T], size: int = PER_STATEMENT) -> Iterator[Sequence[T]]:
    """``items`` in slices of at most ``size``: a statement each."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
