"""Many rows into one SQLite table: multi-row ``INSERT ... VALUES`` statements.

The ingest writes a few thousand rows a batch into ``messages``,
``heartbeats`` and ``local_grad_norms``. An ``executemany`` of one row a
statement pays the driver's per-row round (bind, step, reset) for each; a
statement of :func:`rows_per_statement` rows pays it once for all of them,
which measured 15-30% less CPU per row (batches of 1,600 heartbeats). Full
statements all have the same text, so SQLite's statement cache keeps them
prepared; the few rows left over go through the one-row statement.

>>> import sqlite3
>>> db = sqlite3.connect(":memory:")
>>> _ = db.execute("CREATE TABLE t (a, b)")
>>> insert(db.executemany, "INSERT INTO t (a, b)", 2, [(i, -i) for i in range(1000)])
>>> db.execute("SELECT count(*), sum(a), sum(b) FROM t").fetchone()
(1000, 499500, -499500)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

#: ``executemany``: SQL text and a list of parameter tuples (the ingest passes
#: ``Connection.exec_driver_sql``, so SQLAlchemy's events still see each statement).
ExecuteMany = Callable[[str, list[tuple[Any, ...]]], Any]

#: Bound parameters a statement may have on every SQLite (the limit was 999
#: before 3.32), which sets the rows a statement.
MAX_PARAMETERS = 999


def rows_per_statement(width: int) -> int:
    """Rows of ``width`` columns in one statement (at least one)."""
    return max(1, MAX_PARAMETERS // width)


def insert(
    executemany: ExecuteMany, head: str, width: int, rows: Sequence[tuple[Any, ...]]
) -> None:
    """``head`` (``INSERT [OR IGNORE] INTO table (columns)``) for every row of
    ``rows`` (tuples of ``width`` values), on SQLite."""
    per = rows_per_statement(width)
    one = "(" + ", ".join("?" * width) + ")"
    full = len(rows) // per * per
    if full:
        statement = f"{head} VALUES {', '.join([one] * per)}"
        flat = chain.from_iterable
        executemany(statement, [tuple(flat(rows[i : i + per])) for i in range(0, full, per)])
    if full < len(rows):
        executemany(f"{head} VALUES {one}", list(rows[full:]))
