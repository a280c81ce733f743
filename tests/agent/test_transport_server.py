"""ServerSink against the real nand server (ingest + SQLite + REST), when it is installed."""

from __future__ import annotations

import json
import urllib.request

import pytest

from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.events import Event, FlightWindow, StepSummary

embedded = pytest.importorskip("nand.server.embedded", reason="needs the server extra")
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
