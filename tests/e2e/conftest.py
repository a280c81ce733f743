"""End-to-end fixtures: a real embedded nand server and real training jobs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from nand.server import embedded
from nand.server.embedded import EmbeddedServer
from nand.server.settings import Settings
from tests.e2e import slurm

TOKEN = "e2e-token"


@contextlib.contextmanager
def embedded_test_server(
    folder: Path, heartbeat_s: float = 0.5, lost_after_s: float = 3.0
) -> Iterator[EmbeddedServer]:
    """A real embedded server on a SQLite file in ``folder``, with short heartbeats."""
    db_url = f"sqlite:///{folder / 'nand.db'}"
    settings = Settings(
        db_url=db_url, token=TOKEN, heartbeat_s=heartbeat_s, lost_after_s=lost_after_s
    )
    server = embedded.start(db_url, settings=settings)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nand_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    with embedded_test_server(tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[slurm.Cluster]:
    """A one-node Slurm for the session (tests/e2e/slurm.py), stopped at its end."""
    absent = slurm.missing()
    if absent:
        message = f"Slurm cannot start here, missing: {', '.join(absent)} (scripts/install-slurm)"
        if os.environ.get("CI"):  # installed by scripts/test: never skipped there
            pytest.fail(message)
        pytest.skip(message)
    with slurm.cluster() as cluster:
        yield cluster
