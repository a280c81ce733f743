"""ServerSink against the real nand server (ingest + SQLite + REST)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.events import Event, FlightWindow, StepSummary
from nand.server import embedded
from nand.server.settings import Settings

pytestmark = pytest.mark.slow


def _runs(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/api/runs", timeout=10) as response:
        return json.loads(response.read())


def test_the_real_server_acknowledges_everything_including_a_dead_agents_spool(tmp_path):
    server = embedded.start(f"sqlite:///{tmp_path / 'nand.db'}")
    try:
        rank0 = Identity(run="compat", rank=0, local_rank=0, world_size=2, host="h", pid=1)
        sink = ServerSink(server.zmq_endpoint, rank0, ack_timeout_s=0.5)
        sink.hello({"modules": [{"name": "fc", "type": "Linear"}], "optimizer": "SGD"})
        flight = FlightWindow(steps=[3], modules=["fc"], act_max_abs=[[None]], grad_max_abs=[[1.0]])
        sink.event(Event(run="compat", step=3, module="fc", module_type="Linear", nan=1), flight)
        for step in range(20):
            sink.heartbeat(StepSummary(step=step))
        sink.bye(20, "finished")
        assert sink.flush(15), sink.stats()
        sink.close()

        # Rank 1's first agent never reached the server; its successor replays its spool.
        rank1 = Identity(run="compat", rank=1, local_rank=1, world_size=2, host="h", pid=2)
        dead = ServerSink("tcp://127.0.0.1:1", rank1, connect_grace_s=0.05)
        dead.hello({})
        for step in range(30):
            dead.heartbeat(StepSummary(step=step))
        dead.close(0.5)
        successor = ServerSink(server.zmq_endpoint, rank1, ack_timeout_s=0.5)
        successor.hello({})
        successor.heartbeat(StepSummary(step=31))
        assert successor.flush(15), successor.stats()
        stats = successor.stats()
        successor.close()
        assert stats["acked"] == 31 + 2 and stats["dropped"] == {}

        (run,) = _runs(server.http_url)
        assert (run["run"], run["ranks_seen"], run["event_count"]) == ("compat", 2, 1)
        assert run["origin"]["module"] == "fc" and run["latest_step"] == 31
    finally:
        server.stop()


def test_a_spool_the_server_refuses_costs_its_own_frames_not_the_next_agents(tmp_path):
    """Rank 0's first agent spooled its last messages (its server went away);
    its successor reports to another server with the same token, which never
    saw the first agent's hello: those frames are refused (unauthenticated),
    counted as dropped, and the successor's own messages all get in. Before,
    the refusal stopped the successor: a whole run of it lost."""
    token, rank0 = "t0k", Identity(run="moved", rank=0, local_rank=0, world_size=1, host="h", pid=1)
    first_server = embedded.start(f"sqlite:///{tmp_path}/a.db", settings=Settings(token=token))
    first = ServerSink(first_server.zmq_endpoint, rank0, token=token, ack_timeout_s=0.5)
    first.hello({})
    assert first.flush(15), first.stats()
    first_server.stop()
    for step in range(3):
        first.heartbeat(StepSummary(step=step))
    first.bye(3, "finished")
    first.close(0.5)

    server = embedded.start(f"sqlite:///{tmp_path}/b.db", settings=Settings(token=token))
    try:
        successor = ServerSink(server.zmq_endpoint, rank0, token=token, ack_timeout_s=0.5)
        successor.hello({})
        successor.heartbeat(StepSummary(step=7))
        successor.bye(8, "finished")
        assert successor.flush(15), successor.stats()
        stats = successor.stats()
        successor.close()
        assert stats["rejected"] is None and stats["dropped"] == {"rejected": 4}, stats
        (run,) = _runs(server.http_url)
        assert (run["run"], run["latest_step"], run["state"]) == ("moved", 8, "finished")
    finally:
        server.stop()
