"""Every number a request carries is bounded by what the store holds: the
OpenAPI document says so for each integer, and a number past it is refused
with a 422 that names the bound, never reaches the database as a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nand.server import embedded
from nand.server.embedded import EmbeddedServer
from nand.server.settings import Settings
from nand.server.storage.bounds import INT32, INT64
from tests.server.agents import FakeAgent

TOKEN = "bounds-token"


@pytest.fixture
def sqlite_server(sqlite_url: str) -> Iterator[EmbeddedServer]:
    with embedded.start(sqlite_url, settings=Settings(db_url=sqlite_url)) as server:
        yield server


def _integers(schema: dict[str, Any], components: dict[str, Any], where: str) -> Iterator[tuple]:
    """(where, schema) of every integer in ``schema``, through refs and unions."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        yield from _integers(components[name], components, f"{where}<{name}>")
        return
    if schema.get("type") == "integer":
        yield where, schema
    for union in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(union, []):
            yield from _integers(option, components, where)
    for key, prop in schema.get("properties", {}).items():
        yield from _integers(prop, components, f"{where}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _integers(schema["items"], components, f"{where}[]")


def request_integers(document: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every integer a request may carry: parameters and request bodies."""
    components = document["components"]["schemas"]
    found = []
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            here = f"{method.upper()} {path}"
            for parameter in operation.get("parameters", []):
                where = f"{here} ?{parameter['name']}"
                found += _integers(parameter["schema"], components, where)
            for media in operation.get("requestBody", {}).get("content", {}).values():
                found += _integers(media["schema"], components, f"{here} body")
    return found


def test_every_integer_a_request_carries_has_bounds_the_store_can_hold(sqlite_server) -> None:
    document = httpx.get(f"{sqlite_server.http_url}/openapi.json", timeout=60).json()
    integers = request_integers(document)
    # the walk sees the bodies and the query parameters it must see
    names = {where for where, _ in integers}
    assert "POST /api/runs/{run}/stop body<StopRequest>.step" in names
    assert "GET /api/runs/{run}/events ?step_max" in names
    unbounded = [
        where
        for where, schema in integers
        if not (schema.get("minimum", -1) >= 0 and schema.get("maximum", INT64 + 1) <= INT64)
    ]
    assert not unbounded, f"integers without a minimum and a maximum within INT64: {unbounded}"


@pytest.mark.parametrize("step", [INT32 + 1, 352987928983580560064512])
def test_a_stop_step_past_what_the_store_holds_is_refused_with_a_422_naming_the_bound(
    start_server, step: int
) -> None:
    # Before the bound: OverflowError in store.request_stop on SQLite (2**78),
    # NumericValueOutOfRange on PostgreSQL (2**31): a 500 either way.
    server = start_server(token=TOKEN)
    agent = FakeAgent(server.zmq_endpoint, run="bounded", world_size=1)
    agent.hello(token=TOKEN)
    agent.heartbeat(3)
    agent.wait_acked()
    url = f"{server.http_url}/api/runs/bounded/stop"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    refused = httpx.post(url, json={"step": step}, headers=auth, timeout=30)
    assert refused.status_code == 422, refused.text
    [problem] = refused.json()["detail"]
    assert problem["loc"] == ["body", "step"]
    assert problem["msg"] == f"Input should be less than or equal to {INT32}"
    # nothing was recorded: a stop within the bound is still the first one
    accepted = httpx.post(url, json={"step": INT32}, headers=auth, timeout=30)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["step"] == INT32
    agent.close()
