"""Every run id the server stores can be read back over REST: ids with ``/`` or
that are ``.``/``..`` are refused at the ZeroMQ port with a clear reason, and
every other id is addressable as one encoded path segment."""

from __future__ import annotations

import urllib.parse

import httpx
import pytest

from nand.events import FlightWindow
from nand.runids import MAX_RUN_CHARS, run_problem
from nand.server.storage.models import Run
from tests.server.agents import FakeAgent

REST_PATHS = ("", "/verdict", "/ranks", "/events", "/series", "/flight")


def path_of(run: str) -> str:
    return f"/api/runs/{urllib.parse.quote(run, safe='')}"


@pytest.mark.parametrize("run", ["a/b", "../../etc/passwd", "..", "."])
def test_a_run_id_the_api_cannot_address_is_refused_with_its_reason(server, run: str) -> None:
    agent = FakeAgent(server.zmq_endpoint, run=run)
    agent.hello()
    reason = agent.wait_for("reject")["reason"]
    assert reason.startswith("bad_run: ")
    assert repr(run) in reason
    agent.event(step=0, phase="forward", module="fc1", cause="produced", nan=1)
    agent.pump(0.5)
    assert not agent.acked
    assert httpx.get(f"{server.http_url}/api/runs").json() == []
    metrics = httpx.get(f"{server.http_url}/metrics").text
    assert 'nand_messages_rejected_total{reason="bad_run"} 2.0' in metrics
    agent.close()


@pytest.mark.parametrize("run", ["a<b>", "a b", "a?b#c", "50%", "é-run", "a\\b", "...", "x.."])
def test_every_other_run_id_answers_on_every_rest_path(server, run: str) -> None:
    agent = FakeAgent(server.zmq_endpoint, run=run)
    agent.hello()
    agent.heartbeat(1)
    window = FlightWindow(steps=[0], modules=["fc1"], act_max_abs=[[1.0]], grad_max_abs=[])
    agent.event(window, step=1, phase="forward", module="fc1", cause="produced", nan=1)
    agent.wait_acked()
    for suffix in REST_PATHS:
        response = httpx.get(f"{server.http_url}{path_of(run)}{suffix}")
        assert response.status_code == 200, (suffix, response.text)
    assert httpx.get(f"{server.http_url}{path_of(run)}/verdict").json()["run"] == run
    agent.close()


@pytest.mark.parametrize("run", ["a\x00b", "x" * (MAX_RUN_CHARS + 1)])
def test_a_rest_call_for_an_id_no_run_can_have_says_why(server, run: str) -> None:
    response = httpx.get(f"{server.http_url}{path_of(run)}/verdict")
    assert response.status_code == 404
    assert response.json()["detail"] == run_problem(run)


def test_the_longest_run_id_is_the_longest_the_runs_table_holds() -> None:
    assert Run.__table__.c.name.type.length == MAX_RUN_CHARS
