"""Ingest: acks after commit, rejections by reason, token and CURVE, stop commands, SSE."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
import zmq
from sqlalchemy import create_engine, func, select

from nand import wire
from nand.events import FlightWindow
from nand.server.agents.orders import COMMAND_EVERY_S
from nand.server.storage.models import EventRow, Message
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually


def test_every_ack_is_for_a_message_already_committed(server, agents, db_url) -> None:
    engine = create_engine(db_url)
    a = agents(run="commit")
    for step in range(200):
        a.event(step=step, phase="forward", module="fc")
    seen = 0
    deadline = time.monotonic() + 20
    while seen < 200 and time.monotonic() < deadline:
        for reply in a.pump(0.2):
            if reply["kind"] != "ack":
                continue
            assert reply["agent"] == a.agent  # acks name the agent they are for
            with engine.connect() as conn:  # another connection: sees only committed rows
                stored = conn.scalar(
                    select(func.count())
                    .select_from(Message)
                    .where(Message.agent == a.agent, Message.seq.in_(reply["seqs"]))
                )
            assert stored == len(reply["seqs"])
            seen += len(reply["seqs"])
    assert seen == 200
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(EventRow)) == 200
    engine.dispose()


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"\xc1", "not_msgpack"),
        (wire.encode({"kind": "hello"})[:0] + b"\x01", "not_a_map"),
        (wire.encode({"v": 99, "kind": "event"}), "bad_version"),
        (wire.encode({"kind": "gossip"}), "unknown_kind"),
        (wire.encode({"kind": "ack", "seqs": [1]}), "unknown_kind"),  # a server kind from an agent
        (
            wire.encode(
                {"kind": "event", "agent": "a", "seq": 1, "run": "r", "rank": 0, "time": 1.0}
            ),
            "missing_field",
        ),
        (
            wire.encode(
                wire.agent_message(
                    "heartbeat", agent="a", seq=1, run="r", rank=0, body={"step": "ten"}
                )
            ),
            "bad_field",
        ),
        (
            wire.encode(
                wire.agent_message(
                    "heartbeat", agent="a", seq=2**70, run="r", rank=0, body={"step": 1}
                )
            ),
            "bad_field",
        ),
    ],
    # (the frames hold the time they were built: as ids they would differ
    # between the collections of pytest-xdist's workers)
    ids=[
        "garbage",
        "not-a-map",
        "version-99",
        "unknown-kind",
        "server-kind",
        "no-body",
        "step-as-text",
        "seq-over-64-bits",
    ],
)
def test_bad_frames_are_counted_by_reason_and_the_loop_goes_on(
    server, agents, frame, reason
) -> None:
    a = agents(run="bad")
    a.send_raw(frame)
    good = a.heartbeat(1)
    a.wait_acked({good})
    assert good in a.acked and len(a.acked) == 1
    text = httpx.get(f"{server.http_url}/metrics").text
    assert f'nand_messages_rejected_total{{reason="{reason}"}} 1.0' in text


def test_a_message_in_several_parts_is_read_as_its_last_part_and_the_next_one_whole(
    server, agents
) -> None:
    """The ingest reads a message part by part; a raw peer sending more than one
    part (an agent sends one) must not shift the next message's parts."""
    a = agents(run="parts")
    first = a.message("heartbeat", {"step": 1})
    a.sock.send_multipart([b"not for the server", wire.encode(first)])
    second = a.heartbeat(2)
    a.wait_acked({first["seq"], second})
    assert a.acked == {first["seq"], second}


def test_oversized_frames_are_refused(start_server) -> None:
    server = start_server(max_frame_bytes=10_000)
    a = FakeAgent(server.zmq_endpoint, run="big")
    a.send("heartbeat", {"step": 1, "blob": "x" * 20_000})
    ok = a.heartbeat(2)
    a.wait_acked({ok})
    assert a.acked == {ok}
    text = httpx.get(f"{server.http_url}/metrics").text
    assert 'nand_messages_rejected_total{reason="too_large"} 1.0' in text
    a.close()


def test_token_required_from_agents_when_configured(start_server) -> None:
    server = start_server(token="s3cret")
    stranger = FakeAgent(server.zmq_endpoint, run="auth")
    stranger.heartbeat(1)
    assert "unauthenticated" in stranger.wait_for("reject")["reason"]
    wrong = FakeAgent(server.zmq_endpoint, run="auth", rank=1)
    wrong.hello(token="nope")
    assert wrong.wait_for("reject")
    good = FakeAgent(server.zmq_endpoint, run="auth", rank=2)
    good.hello(token="s3cret")
    good.heartbeat(3)
    good.wait_acked()
    # A reconnect (new socket, same agent id) stays authenticated: the database
    # remembers. The new connection takes the id over once the old one is gone.
    again = good.reconnected()
    again.send_until_acked("heartbeat", {"step": 4})
    ranks = httpx.get(f"{server.http_url}/api/runs/auth/ranks").json()["items"]
    assert [r["rank"] for r in ranks] == [2]
    text = httpx.get(f"{server.http_url}/metrics").text
    assert 'nand_messages_rejected_total{reason="unauthenticated"} 2.0' in text
    for agent in (stranger, wrong, good, again):
        agent.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encryption_when_a_secret_key_is_set(start_server) -> None:
    server_public, server_secret = zmq.curve_keypair()
    server = start_server(curve_secret_key=server_secret.decode())
    public, secret = zmq.curve_keypair()
    keys = (server_public.decode(), public.decode(), secret.decode())
    sealed = FakeAgent(server.zmq_endpoint, run="curve", curve=keys)
    sealed.heartbeat(1)
    sealed.wait_acked()
    plain = FakeAgent(server.zmq_endpoint, run="plain")
    # The server drops a connection that fails the handshake; a send made
    # after that has no peer to be queued for and would wait for one.
    plain.sock.setsockopt(zmq.SNDTIMEO, 1000)
    with contextlib.suppress(zmq.Again):
        plain.heartbeat(1)
    plain.pump(1.0)
    assert not plain.acked
    runs = [r["run"] for r in httpx.get(f"{server.http_url}/api/runs").json()]
    assert runs == ["curve"]
    sealed.close()
    plain.close()


def test_stop_needs_a_configured_token(server, agents) -> None:
    a = agents(run="nostop")
    a.heartbeat(1)
    a.wait_acked()
    response = httpx.post(f"{server.http_url}/api/runs/nostop/stop")
    assert response.status_code == 403
    assert "NAND_TOKEN" in response.json()["detail"]


def test_stop_reaches_every_rank_with_one_step(start_server) -> None:
    server = start_server(token="tok", heartbeat_s=1.0)
    ranks = [FakeAgent(server.zmq_endpoint, run="halt", rank=r, world_size=3) for r in range(3)]
    for a in ranks:
        a.hello(token="tok")
        a.heartbeat(100 + a.rank, steps_per_s=5.0)
        a.wait_acked()
    url = f"{server.http_url}/api/runs/halt/stop"
    assert httpx.post(url).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer bad"}).status_code == 401
    answer = httpx.post(url, headers={"Authorization": "Bearer tok"}, json={"reason": "NaN"})
    assert answer.status_code == 200
    body = answer.json()
    assert body == {"run": "halt", "step": 102 + 10, "ranks": [0, 1, 2]}  # latest + 2 s x 5 steps/s
    for a in ranks:  # pushed without the agents sending anything
        command = a.wait_for("stop", timeout=5)
        assert command["command"] == "stop" and command["step"] == 112
        assert command["reason"] == "NaN"
    again = httpx.post(url, headers={"Authorization": "Bearer tok"}, json={"step": 500})
    assert again.json()["step"] == 112  # the first request wins
    verdict = httpx.get(f"{server.http_url}/api/runs/halt/verdict").json()
    assert verdict["stop"]["step"] == 112
    ranks[0].bye(110, reason="stopped")
    ranks[0].wait_acked()
    time.sleep(COMMAND_EVERY_S)  # commands to one connection are spaced by this much
    ranks[1].heartbeat(105)  # still running: told again
    assert ranks[1].wait_for("stop", timeout=5)["step"] == 112
    for a in ranks:
        a.close()


def test_stop_rejects_a_step_that_has_passed_and_finished_runs(start_server) -> None:
    server = start_server(token="tok")
    a = FakeAgent(server.zmq_endpoint, run="late")
    a.hello(token="tok")
    a.heartbeat(50)
    a.wait_acked()
    auth = {"Authorization": "Bearer tok"}
    url = f"{server.http_url}/api/runs/late/stop"
    assert httpx.post(url, headers=auth, json={"step": 50}).status_code == 409
    assert httpx.post(url, headers=auth, json={"step": -1}).status_code == 422
    assert httpx.post(f"{server.http_url}/api/runs/ghost/stop", headers=auth).status_code == 404
    a.bye(60)
    a.wait_acked()
    assert httpx.post(url, headers=auth).status_code == 409
    a.close()


def test_stream_sends_a_run_event_when_a_run_appears_and_diverges(server, agents) -> None:
    seen: list[dict] = []
    done = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", f"{server.http_url}/api/stream", timeout=20) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            event = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "run":
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["state"] == "diverged":
                        done.set()
                        return

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    a = agents(run="live")
    a.heartbeat(1)
    a.wait_acked()
    eventually(lambda: any(s["run"] == "live" for s in seen), timeout=10)
    a.event(step=2, phase="backward", module="fc", nan=1)
    a.wait_acked()
    assert done.wait(10)
    assert seen[-1]["origin"]["phase"] == "backward"
    assert next(s["state"] for s in seen if s["run"] == "live") == "healthy"


def test_an_event_without_a_window_makes_the_server_ask_for_one_once(server, agents) -> None:
    bare = agents(run="ask", rank=0)
    bare.event(step=3, phase="forward", module="fc", nan=1)
    assert bare.wait_for("send_flight", timeout=5)["command"] == "send_flight"
    bare.event(step=3, phase="grad", module="fc.weight", nan=1)  # asked once per rank
    bare.wait_acked()
    bare.pump(0.3)
    assert not [c for c in bare.commands if c["command"] == "send_flight"]
    covered = agents(run="ask", rank=1)
    window = FlightWindow(steps=[2], modules=["fc"], act_max_abs=[[1.0]], grad_max_abs=[])
    covered.event(step=3, phase="grad", module="fc.weight", nan=1, flight=window)
    covered.wait_acked()
    covered.pump(0.3)
    assert covered.commands == []
    bare.flight(window)
    bare.wait_acked()
    flight = httpx.get(f"{server.http_url}/api/runs/ask/flight").json()
    assert flight["rank"] == 0 and flight["steps"] == [2]


def test_openapi_documents_every_route_with_typed_responses(server) -> None:
    spec = httpx.get(f"{server.http_url}/openapi.json").json()
    paths = spec["paths"]
    for path in (
        "/api/runs",
        "/api/runs/{run}",
        "/api/runs/{run}/ranks",
        "/api/runs/{run}/events",
        "/api/runs/{run}/verdict",
        "/api/runs/{run}/series",
        "/api/runs/{run}/flight",
        "/api/runs/{run}/stop",
        "/api/stream",
        "/healthz",
        "/metrics",
    ):
        assert path in paths, path
    verdict = paths["/api/runs/{run}/verdict"]["get"]["responses"]["200"]
    assert verdict["content"]["application/json"]["schema"]["$ref"].endswith("/Verdict")
    assert "Verdict" in spec["components"]["schemas"]


@pytest.mark.timed
def test_a_server_stops_without_waiting_out_the_descriptor_gate(start_server) -> None:
    """The gate's thread waits on the ingest socket's monitor for up to a
    second at a time; stopping ends the monitoring, which wakes it (every
    test's server took 1.1 s to stop before)."""
    server = start_server()
    time.sleep(0.05)  # the gate is waiting
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 0.8
