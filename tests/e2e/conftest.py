"""End-to-end fixtures: a real embedded nand server and real training jobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nand.server import embedded
from nand.server.embedded import EmbeddedServer
from nand.server.settings import Settings

TOKEN = "e2e-token"


@pytest.fixture
def nand_server(tmp_path) -> Iterator[EmbeddedServer]:
    db_url = f"sqlite:///{tmp_path / 'nand.db'}"
    settings = Settings(db_url=db_url, token=TOKEN, heartbeat_s=0.5, lost_after_s=3.0)
    server = embedded.start(db_url, settings=settings)
    yield server
    server.stop()
