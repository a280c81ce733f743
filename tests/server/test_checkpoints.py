"""SQLite's WAL is copied into the database file every ``CHECKPOINT_PAGES``
pages, not after every batch of a big run (``nand.server.storage.db``): a real
SQLite file, a 60,000-rank run, and a batch of 6,000 heartbeats of ranks
spread over it through the real writer."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from benchmarks.heartbeat_batch import build, heartbeats
from nand.server.agents.writer import write_batch
from nand.server.storage.db import CHECKPOINT_PAGES, make_engine

PAGE = 4096
#: A WAL frame: a 24-byte header and a page; the file starts with 32 bytes.
FRAME = 24 + PAGE


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_big_runs_batch_of_heartbeats_leaves_the_database_file_to_the_next_checkpoint(
    tmp_path,
) -> None:
    path = tmp_path / "nand.db"
    build(path, 60_000)
    before = _digest(path)

    engine = make_engine(f"sqlite:///{path}")  # (open: the last connection's close checkpoints)
    write_batch(engine, heartbeats(60_000, 6_000, round_=0, spread=True), time.time())

    frames = (path.with_name("nand.db-wal").stat().st_size - 32) // FRAME
    after = _digest(path)
    engine.dispose()
    # More pages than SQLite's default checkpoint threshold: it would have
    # copied them into the file at the commit.
    assert 1_000 < frames < CHECKPOINT_PAGES, frames
    assert after == before, "the batch's commit checkpointed the WAL"
