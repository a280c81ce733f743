"""Schema migrations: an empty database upgrades to head, the models match the
head, and a database written by an earlier revision opens with data intact."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from nand.server import migrate
from nand.server.db import make_engine
from nand.server.models import Base


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
