"""The REST server against a web page in a browser: DNS rebinding (a foreign
``Host``) is refused, and every response carries the security headers. Real
HTTP to a real embedded server."""

from __future__ import annotations

import socket

import httpx
import pytest

from nand.server import embedded
from nand.server.http.guard import BrowserGuard
from nand.server.settings import Settings
from tests.server.agents import FakeAgent


@pytest.fixture
def server(sqlite_url):
    settings = Settings(db_url=sqlite_url, allowed_hosts=("nand.example.org",))
    with embedded.start(sqlite_url, settings=settings) as server:
        agent = FakeAgent(server.zmq_endpoint, run="secret-run")
        agent.heartbeat(1)
        agent.wait_acked()
        agent.close()
        yield server


def get(server, path: str, host: str) -> httpx.Response:
    return httpx.get(f"{server.http_url}{path}", headers={"Host": host})


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8080", "127.0.0.1.nip.io"])
def test_a_rebound_name_cannot_read_the_runs(server, host: str) -> None:
    for path in ("/api/runs", "/api/runs/secret-run/verdict", "/", "/healthz"):
        response = get(server, path, host)
        assert response.status_code == 400, path
        assert "secret-run" not in response.text
        assert "NAND_ALLOWED_HOSTS" in response.json()["detail"]


@pytest.mark.parametrize(
    "host", ["127.0.0.1:1234", "localhost:8080", "[::1]:8080", "NAND.example.org", "app.localhost"]
)
def test_the_bound_address_and_configured_names_are_answered(server, host: str) -> None:
    response = get(server, "/api/runs", host)
    assert response.status_code == 200
    assert [r["run"] for r in response.json()] == ["secret-run"]


def test_every_response_carries_the_security_headers(server) -> None:
    for path in ("/", "/api/runs", "/api/runs/nope", "/docs"):
        headers = httpx.get(f"{server.http_url}{path}").headers
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["x-frame-options"] == "DENY"
        assert headers["referrer-policy"] == "no-referrer"
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
    dashboard = httpx.get(f"{server.http_url}/").headers["content-security-policy"]
    assert "'unsafe-inline'" not in dashboard


def test_a_server_bound_to_all_interfaces_answers_to_this_machines_name() -> None:
    everywhere = BrowserGuard(None, bind_host="0.0.0.0")
    assert everywhere.allows(f"{socket.gethostname()}:8080")
    assert not everywhere.allows("attacker.example")
    assert BrowserGuard(None, bind_host="0.0.0.0", allowed=("*",)).allows("attacker.example")
    assert BrowserGuard(None, bind_host="head-node").allows("head-node:8080")
