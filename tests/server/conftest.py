"""Server test fixtures: a real SQLite file and a real PostgreSQL, a real
embedded server on free ports, and real ZeroMQ DEALER sockets as agents."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from nand.server import embedded
from nand.server.embedded import EmbeddedServer
from nand.server.settings import Settings
from tests.server import pg
from tests.server.agents import FakeAgent


@pytest.fixture(scope="session")
def postgres() -> Iterator[pg.Cluster]:
    if pg.find_bin() is None:
        if os.environ.get("CI"):  # the multi-server tests must run there, not skip
            pytest.fail("PostgreSQL binaries not installed on CI (set NAND_TEST_PG_BIN)")
        pytest.skip("PostgreSQL binaries not installed")
    cluster = pg.start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'nand.db'}"
        return
    cluster: pg.Cluster = request.getfixturevalue("postgres")
    with cluster.database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'nand.db'}"


ServerFactory = Callable[..., EmbeddedServer]


@pytest.fixture
def start_server(db_url: str) -> Iterator[ServerFactory]:
    """Start embedded servers on ``db_url`` (settings overridable); stopped at teardown."""
    started: list[EmbeddedServer] = []

    def start(**overrides: object) -> EmbeddedServer:
        settings = Settings(db_url=db_url, **overrides)  # type: ignore[arg-type]
        server = embedded.start(db_url, settings=settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def server(start_server: ServerFactory) -> EmbeddedServer:
    return start_server()


@pytest.fixture
def agents(server: EmbeddedServer) -> Iterator[Callable[..., FakeAgent]]:
    """Make agents connected to ``server``; closed at teardown."""
    made: list[FakeAgent] = []

    def make(run: str = "run-1", rank: int = 0, **kwargs: object) -> FakeAgent:
        agent = FakeAgent(server.zmq_endpoint, run=run, rank=rank, **kwargs)  # type: ignore[arg-type]
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()
