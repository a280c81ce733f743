"""Schema migrations: an empty database upgrades to head, the models match the
head, and a database written by an earlier revision opens with data intact."""

from __future__ import annotations

import time

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text

from nand import wire
from nand.server.agents.writer import write_batch
from nand.server.storage import migrate
from nand.server.storage.db import make_engine
from nand.server.storage.models import Base, Run


def test_empty_database_upgrades_to_head_and_models_match_it(db_url) -> None:
    engine = make_engine(db_url)
    assert migrate.current_revision(engine) is None
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models differ from the migration head: {diff}"
    tables = set(inspect(engine).get_table_names())
    assert {"runs", "ranks", "events", "heartbeats", "flights", "messages", "agents"} <= tables
    engine.dispose()


def test_every_revision_upgrades_in_turn_and_keeps_data(db_url) -> None:
    engine = make_engine(db_url)
    script = ScriptDirectory.from_config(migrate.alembic_config())
    revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
    migrate.upgrade(engine, revisions[0])
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (name, world_size, started_at, last_seen, updated_at, "
                "latest_step, event_count, optimizer, stop_reason) "
                "VALUES ('old', 2, 1.0, 2.0, 2.0, 7, 0, '', '')"
            )
        )
    for revision in revisions[1:]:
        migrate.upgrade(engine, revision)
    migrate.upgrade(engine)  # and opening it again is a no-op
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name, latest_step FROM runs")).all() == [("old", 7)]
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def test_migrations_ship_with_the_package() -> None:
    assert (migrate.MIGRATIONS / "env.py").is_file()
    assert list((migrate.MIGRATIONS / "versions").glob("0001_*.py"))


def test_a_database_of_revision_0002_upgrades_to_attempts_and_takes_a_rerun(db_url) -> None:
    engine = make_engine(db_url)
    migrate.upgrade(engine, "0002")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (name, world_size, started_at, last_seen, updated_at, "
                "latest_step, event_count, optimizer, stop_reason) "
                "VALUES ('job', 1, 1.0, 2.0, 2.0, 7, 0, '', '')"
            )
        )
    migrate.upgrade(engine)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, attempt, superseded_at, launch FROM runs")).all()
    assert rows == [("job", 1, None, None)]
    # The same name now takes a second attempt (the unique name is gone).
    for agent, launch in (("a1", "uid-1"), ("a2", "uid-2")):
        hello = {"world_size": 1, "host": "h", "pid": len(launch), "launch": launch}
        message = wire.agent_message("hello", agent=agent, seq=1, run="job", rank=0, body=hello)
        write_batch(engine, [wire.decode(wire.encode(message))], time.time())
    with engine.connect() as conn:
        query = "SELECT attempt, launch, superseded_at IS NULL FROM runs ORDER BY attempt"
        rows = conn.execute(text(query)).all()
    assert [tuple(r) for r in rows] == [(1, "uid-1", False), (2, "uid-2", True)]
    engine.dispose()


def test_a_database_of_revision_0012_upgrades_to_tallies_that_count_its_ranks(db_url) -> None:
    from alembic import command
    from sqlalchemy.orm import Session

    from tests.server.test_big_runs import _mixed_run, kept_tally, recounted_tally

    engine = make_engine(db_url)
    # Every kind of rank, written by today's ingest and then taken back to
    # 0012's tables (no tallies; the later columns of events dropped): the
    # ingest of 0012 is gone, its data is what an upgrade meets.
    migrate.upgrade(engine)
    _mixed_run(engine, "before", 70, time.time())
    with engine.begin() as connection:
        command.downgrade(migrate.alembic_config(connection), "0012")
    assert migrate.current_revision(engine) == "0012"
    migrate.upgrade(engine)
    _mixed_run(engine, "after", 70, time.time())
    with Session(engine) as session:
        for name in ("before", "after"):
            run = session.scalars(select(Run).where(Run.name == name)).one()
            recounted = recounted_tally(session, run)
            assert all(recounted.values()), (name, recounted)
            assert kept_tally(session, run) == recounted, name
    engine.dispose()
