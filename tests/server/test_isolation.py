"""Run isolation over the ZeroMQ port: forged and hijacking clients against a real
server. Each agent id is bound to the (run, rank) and the connection it said
hello on; messages claiming another identity are refused and counted."""

from __future__ import annotations

import httpx
import pytest

from tests.server.agents import FakeAgent

TOKEN = "tok"


def rejected(server, reason: str) -> float:
    text = httpx.get(f"{server.http_url}/metrics").text
    line = f'nand_messages_rejected_total{{reason="{reason}"}} '
    return float(text.split(line, 1)[1].split("\n", 1)[0])


def events(server, run: str) -> list[dict]:
    return httpx.get(f"{server.http_url}/api/runs/{run}/events").json()["items"]


@pytest.fixture
def secured(start_server):
    return start_server(token=TOKEN)


def test_an_authenticated_agent_cannot_write_into_another_run(secured) -> None:
    victim = FakeAgent(secured.zmq_endpoint, run="victim", rank=0, world_size=2)
    victim.hello(token=TOKEN)
    victim.heartbeat(5)
    victim.wait_acked()
    attacker = FakeAgent(secured.zmq_endpoint, run="mine", rank=0)
    attacker.hello(token=TOKEN)
    attacker.wait_acked()
    # The attacker's own, authenticated agent id, claiming the victim's run and rank 1.
    attacker.run, attacker.rank = "victim", 1
    forged = attacker.event(step=1, phase="forward", module="fc1", cause="produced", nan=1)
    attacker.pump(1.0)
    assert forged not in attacker.acked
    assert events(secured, "victim") == []
    verdict = httpx.get(f"{secured.http_url}/api/runs/victim/verdict").json()
    assert verdict["origin"] is None
    assert rejected(secured, "identity_mismatch") == 1.0
    for agent in (victim, attacker):
        agent.close()


def test_without_a_token_an_agent_still_keeps_to_its_own_run(server) -> None:
    honest = FakeAgent(server.zmq_endpoint, run="own", rank=0)
    honest.hello()
    honest.wait_acked()
    other = FakeAgent(server.zmq_endpoint, run="other", rank=0)
    other.hello()
    other.wait_acked()
    honest.run = "other"
    honest.event(step=0, phase="forward", module="fc1", cause="produced", nan=1)
    honest.pump(1.0)
    assert events(server, "other") == []
    assert rejected(server, "identity_mismatch") == 1.0
    honest.close()
    other.close()


def test_a_connection_that_never_sent_the_token_cannot_use_an_id_authenticated_later(
    secured,
) -> None:
    real = FakeAgent(secured.zmq_endpoint, run="hijack", rank=0)
    squatter = FakeAgent(secured.zmq_endpoint, run="hijack", rank=0, agent=real.agent)
    squatter.heartbeat(1)
    assert "unauthenticated" in squatter.wait_for("reject")["reason"]
    real.hello(token=TOKEN)
    real.wait_acked()
    squatter.seq = 10
    late = squatter.event(step=2, phase="forward", module="fc2", cause="produced", nan=1)
    squatter.pump(1.0)
    assert late not in squatter.acked
    assert events(secured, "hijack") == []
    assert rejected(secured, "agent_in_use") == 1.0
    real.close()
    squatter.close()


def test_seqs_pre_sent_by_another_connection_do_not_shadow_the_real_messages(server) -> None:
    real = FakeAgent(server.zmq_endpoint, run="shadow", rank=0)
    real.hello()
    real.wait_acked()
    forger = FakeAgent(server.zmq_endpoint, run="shadow", rank=0, agent=real.agent)
    forger.seq = real.seq  # the next seq the real agent will use
    forger.event(step=0, phase="forward", module="forged", cause="produced", nan=1)
    forger.pump(1.0)
    real.event(step=3, phase="forward", module="fc1", cause="produced", nan=1)
    real.wait_acked()
    assert [e["module"] for e in events(server, "shadow")] == ["fc1"]
    assert rejected(server, "agent_in_use") == 1.0
    real.close()
    forger.close()


def test_an_agent_that_reconnects_keeps_its_identity(secured) -> None:
    first = FakeAgent(secured.zmq_endpoint, run="again", rank=3, world_size=4)
    first.hello(token=TOKEN)
    first.heartbeat(1)
    first.wait_acked()
    second = first.reconnected()
    second.send_until_acked("heartbeat", {"step": 2})
    ranks = httpx.get(f"{secured.http_url}/api/runs/again/ranks").json()["items"]
    assert [(r["rank"], r["step"]) for r in ranks] == [(3, 2)]
    second.close()
