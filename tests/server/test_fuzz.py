"""Fuzzing: whatever passes the decoder is storable (no poison batch), no frame
stops the ingest loop, and no REST parameter gives a 500 or a non-JSON body."""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nand import wire
from nand.errors import WireError
from nand.events import PHASES
from nand.server.agents.writer import write_batch
from nand.server.http.app import create_app
from nand.server.settings import Settings
from nand.server.storage.db import make_engine
from nand.server.storage.migrate import upgrade
from nand.server.storage.sanitize import out_of_range
from tests.server import pg
from tests.server.agents import FakeAgent

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
ints = st.integers(min_value=-(2**65), max_value=2**65) | st.integers(0, 50)
texts = st.text(max_size=40) | st.sampled_from(["", "a\x00b", "é" * 300, "fc1"])
floats = st.floats(allow_nan=True, allow_infinity=True)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return strategy | anything


# Required fields have the right types with extreme values (so that many
# messages pass the decoder and reach the database); optional ones anything.
events = st.fixed_dictionaries(
    {
        "phase": st.sampled_from(PHASES),
        "step": ints,
        "micro_step": ints,
        "order": ints,
        "module": texts,
        "cause": texts,
    },
    optional={
        "nan": maybe(ints),
        "posinf": maybe(ints),
        "min": maybe(floats),
        "max_abs": maybe(floats),
        "shape": maybe(st.lists(ints, max_size=4)),
        "dtype": maybe(texts),
        "host": maybe(texts),
        "pid": maybe(ints),
        "world_size": maybe(ints),
        "time": maybe(floats),
        "module_type": maybe(texts),
        "message": maybe(texts),
        "call": maybe(ints),
        "extra": anything,
    },
)
bodies = {
    "event": st.fixed_dictionaries({"event": events}, optional={"flight": anything}),
    "heartbeat": st.fixed_dictionaries(
        {"step": ints},
        optional={"loss": maybe(floats), "steps_per_s": maybe(floats), "amp_skipped": anything},
    ),
    "hello": st.fixed_dictionaries(
        {"world_size": ints, "host": texts, "pid": ints},
        optional={"modules": anything, "optimizer": anything, "versions": anything},
    ),
    "bye": st.fixed_dictionaries({"step": ints}, optional={"reason": anything}),
    "flight": st.fixed_dictionaries(
        {
            "flight": st.fixed_dictionaries(
                {
                    "steps": st.lists(ints, max_size=3),
                    "modules": st.lists(texts, max_size=2),
                    "act_max_abs": st.just([]),
                    "grad_max_abs": st.just([]),
                },
                optional={"grad_norm": anything, "dtype_max": anything, "loss": anything},
            )
            | anything
        },
        optional={"reason": anything},
    ),
}
messages = st.sampled_from(sorted(bodies)).flatmap(
    lambda kind: st.fixed_dictionaries(
        {
            "v": st.just(1),
            "kind": st.just(kind),
            "agent": st.text(min_size=1, max_size=10),
            "seq": ints,
            "run": texts,
            "rank": ints,
            "time": floats | ints,
            "body": bodies[kind],
        }
    )
)


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def engine_url(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.db'}"
        return
    if pg.find_bin() is None:
        pytest.skip("PostgreSQL binaries not installed")
    cluster: pg.Cluster = request.getfixturevalue("postgres")
    with cluster.database() as url:
        yield url


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(message=messages)
def test_whatever_the_decoder_accepts_the_store_accepts(engine_url: str, message: dict) -> None:
    try:
        decoded = wire.decode(wire.encode(message))
        if out_of_range(decoded) is not None:
            return
    except WireError:
        return
    engine = _engines.setdefault(engine_url, _engine(engine_url))
    result = write_batch(engine, [decoded], time.time())
    assert result.acked == [(decoded["agent"], decoded["seq"])]


_engines: dict[str, Any] = {}


def _engine(url: str) -> Any:
    engine = make_engine(url)
    upgrade(engine)
    return engine


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from nand.server import embedded

    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'frames.db'}"
    server = embedded.start(url, settings=Settings(db_url=url))
    yield server
    server.stop()


@settings(max_examples=5, deadline=None)
@given(batch=st.lists(st.binary(max_size=200) | messages.map(wire.encode), max_size=300))
def test_random_frames_never_stop_the_ingest_loop(fuzz_server: Any, batch: list[bytes]) -> None:
    agent = FakeAgent(fuzz_server.zmq_endpoint, run="fuzz")
    try:
        for frame in batch:
            agent.send_raw(frame)
        good = agent.heartbeat(1)  # the loop still answers a well-formed message
        agent.wait_acked({good}, timeout=20)
    finally:
        agent.close()


@pytest.fixture(scope="module")
def client(engine_url: str) -> Iterator[TestClient]:
    app = create_app(Settings(db_url=engine_url), ingest=False)
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        engine = app.state.nand.engine
        for seq, kind, body in (
            (1, "hello", {"world_size": 2, "host": "h", "pid": 1, "modules": [{"name": "fc"}]}),
            (2, "heartbeat", {"step": 3, "loss": float("nan")}),
            (
                3,
                "event",
                {
                    "event": {
                        "step": 4,
                        "micro_step": 0,
                        "phase": "forward",
                        "module": "fc",
                        "order": 0,
                        "cause": "produced",
                        "max": float("inf"),
                    },
                    "flight": {
                        "steps": [3],
                        "modules": ["fc"],
                        "act_max_abs": [[1.0]],
                        "grad_max_abs": [],
                    },
                },
            ),
        ):
            message = wire.agent_message(kind, agent="fz", seq=seq, run="fz", rank=0, body=body)
            write_batch(engine, [wire.decode(wire.encode(message))], time.time())
        yield test_client


params = st.dictionaries(
    st.sampled_from(
        ["rank", "phase", "module", "step_min", "step_max", "offset", "limit", "points", "x"]
    ),
    st.text(max_size=12) | st.integers(-(2**70), 2**70).map(str) | st.sampled_from(PHASES),
    max_size=5,
)
paths = st.sampled_from(["", "/verdict", "/ranks", "/events", "/series", "/flight"])
runs = st.sampled_from(["fz", "nope"]) | st.text(max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(run=runs, path=paths, query=params)
def test_rest_parameters_never_give_a_500(
    client: TestClient, run: str, path: str, query: dict
) -> None:
    quoted = urllib.parse.quote(run, safe="")
    if not quoted or quoted in (".", ".."):
        quoted = "fz"
    response = client.get(f"/api/runs/{quoted}{path}", params=query)
    assert response.status_code < 500, response.text
    json.loads(response.text)  # valid JSON, no NaN


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(query=params, body=anything)
def test_list_and_stop_parameters_never_give_a_500(
    client: TestClient, query: dict, body: Any
) -> None:
    assert client.get("/api/runs", params=query).status_code < 500
    response = client.post("/api/runs/fz/stop", content=json.dumps(body, default=str))
    assert response.status_code < 500
