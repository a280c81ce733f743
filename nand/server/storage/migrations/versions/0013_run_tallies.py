"""run_tallies: each run's ranks counted by what the ingest knows, kept by triggers;
partial indexes for the time-dependent states

Revision ID: 0013
Revises: 0012

A verdict of a 100,000-rank run counted every rank row per request (a GROUP
BY). Now a row per run counts its ranks: seen, diverged (a first non-finite
event), diverged and gone (said bye), crashed, finished, in the order of
``correlate.rank_state``. Triggers on ``ranks`` keep it in the transaction
that changes a rank, whoever changes it (the ingest of any server, prune, a
copy in SQL), with ``n = n + d`` on the run's row: the row lock orders two
servers' updates, nothing is read and written back. The states that depend on
the time (lost, stalled) are range counts over partial indexes of the open
ranks (not diverged, no bye) by ``last_seen`` and by ``step_changed_at``.
See ``nand.server.analysis.counts``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

#: Tally column -> the rank classes it counts (see _CLASS; 0, open, is not tallied).
COUNTED = {
    "diverged": (1, 2),
    "diverged_gone": (2,),
    "crashed": (3,),
    "finished": (4,),
}
#: A run's origin is the least of its ranks' first keys: read off this index in order.
FIRST_KEY = ["run_id", "first_step", "first_micro_step", "first_phase_rank", "first_order", "rank"]
OPEN = "first_event_id IS NULL AND finished_at IS NULL"
CLOSED = "first_event_id IS NULL AND finished_at IS NOT NULL"


def _class(row: str, find: str) -> str:
    """A rank's class as an integer (``row``: NEW or OLD; ``find``: instr or strpos):
    1 diverged, 2 diverged and said bye, 3 crashed, 4 finished, 0 open."""
    reason = f"{row}.bye_reason"
    crashed = f"substr({reason}, 1, 10) = 'exception:' AND {find}({reason}, 'StopRequested') = 0"
    return (
        f"(CASE WHEN {row}.first_event_id IS NOT NULL THEN "
        f"(CASE WHEN {row}.finished_at IS NULL THEN 1 ELSE 2 END) "
        f"WHEN {crashed} THEN 3 WHEN {row}.finished_at IS NOT NULL THEN 4 ELSE 0 END)"
    )


def _is(code: str, column: str) -> str:
    classes = ", ".join(str(c) for c in COUNTED[column])
    return f"(CASE WHEN {code} IN ({classes}) THEN 1 ELSE 0 END)"


def _sets(new: str | None, old: str | None, ranks: str) -> str:
    """``col = col + [new is counted] - [old is counted]`` for every tally column."""
    sets = [f"ranks = ranks + {ranks}"]
    for column in COUNTED:
        plus = f" + {_is(new, column)}" if new else ""
        minus = f" - {_is(old, column)}" if old else ""
        sets.append(f"{column} = {column}{plus}{minus}")
    return ", ".join(sets)


def _sqlite_triggers() -> list[str]:
    new, old = _class("NEW", "instr"), _class("OLD", "instr")
    return [
        "CREATE TRIGGER run_tallies_run AFTER INSERT ON runs "
        "BEGIN INSERT INTO run_tallies (run_id) VALUES (NEW.id); END",
        "CREATE TRIGGER run_tallies_rank_in AFTER INSERT ON ranks BEGIN "
        f"UPDATE run_tallies SET {_sets(new, None, '1')} WHERE run_id = NEW.run_id; END",
        "CREATE TRIGGER run_tallies_rank_change "
        "AFTER UPDATE OF first_event_id, finished_at, bye_reason ON ranks "
        f"WHEN {new} <> {old} BEGIN "
        f"UPDATE run_tallies SET {_sets(new, old, '0')} WHERE run_id = NEW.run_id; END",
        "CREATE TRIGGER run_tallies_rank_out AFTER DELETE ON ranks BEGIN "
        f"UPDATE run_tallies SET {_sets(None, old, '-1')} WHERE run_id = OLD.run_id; END",
    ]


def _postgresql_triggers() -> list[str]:
    new, old = _class("NEW", "strpos"), _class("OLD", "strpos")
    return [
        "CREATE FUNCTION nand_tally_run() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "INSERT INTO run_tallies (run_id) VALUES (NEW.id); RETURN NULL; END $$",
        "CREATE TRIGGER run_tallies_run AFTER INSERT ON runs "
        "FOR EACH ROW EXECUTE FUNCTION nand_tally_run()",
        "CREATE FUNCTION nand_tally_rank() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF TG_OP = 'INSERT' THEN UPDATE run_tallies SET {_sets(new, None, '1')} "
        "WHERE run_id = NEW.run_id; "
        f"ELSIF TG_OP = 'DELETE' THEN UPDATE run_tallies SET {_sets(None, old, '-1')} "
        "WHERE run_id = OLD.run_id; "
        f"ELSIF {new} <> {old} THEN UPDATE run_tallies SET {_sets(new, old, '0')} "
        "WHERE run_id = NEW.run_id; "
        "END IF; RETURN NULL; END $$",
        "CREATE TRIGGER run_tallies_rank AFTER INSERT OR DELETE "
        "OR UPDATE OF first_event_id, finished_at, bye_reason ON ranks "
        "FOR EACH ROW EXECUTE FUNCTION nand_tally_rank()",
    ]


def _backfill() -> str:
    code = _class("ranks", "strpos" if op.get_context().dialect.name == "postgresql" else "instr")
    sums = ", ".join(f"COALESCE(SUM({_is(code, c)}), 0)" for c in COUNTED)
    return (
        f"INSERT INTO run_tallies (run_id, ranks, {', '.join(COUNTED)}) "
        f"SELECT runs.id, COUNT(ranks.id), {sums} "
        "FROM runs LEFT JOIN ranks ON ranks.run_id = runs.id GROUP BY runs.id"
    )


def _partial(name: str, columns: list[str], where: str) -> None:
    clause = sa.text(where)
    op.create_index(
        name, "ranks", columns, sqlite_where=clause, postgresql_where=clause, unique=False
    )


def upgrade() -> None:
    op.create_table(
        "run_tallies",
        sa.Column("run_id", sa.Integer(), nullable=False),
        *(
            sa.Column(column, sa.Integer(), nullable=False, server_default="0")
            for column in ("ranks", *COUNTED)
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id"),
    )
    op.execute(_backfill())
    _partial("ix_ranks_open_seen", ["run_id", "last_seen"], OPEN)
    _partial("ix_ranks_open_step", ["run_id", "step_changed_at", "last_seen"], OPEN)
    _partial("ix_ranks_closed", ["run_id", "rank"], CLOSED)
    _partial("ix_ranks_dropped", ["run_id", "rank"], "dropped IS NOT NULL")
    _partial("ix_ranks_first_key", FIRST_KEY, "first_event_id IS NOT NULL")
    dialect = op.get_context().dialect.name
    for statement in _postgresql_triggers() if dialect == "postgresql" else _sqlite_triggers():
        op.execute(statement)


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute("DROP TRIGGER run_tallies_rank ON ranks")
        op.execute("DROP TRIGGER run_tallies_run ON runs")
        op.execute("DROP FUNCTION nand_tally_rank()")
        op.execute("DROP FUNCTION nand_tally_run()")
    else:
        for name in ("run", "rank_in", "rank_change", "rank_out"):
            op.execute(f"DROP TRIGGER run_tallies_{name}")
    for name in ("first_key", "dropped", "closed", "open_step", "open_seen"):
        op.drop_index(f"ix_ranks_{name}", table_name="ranks")
    op.drop_table("run_tallies")
