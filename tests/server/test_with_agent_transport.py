"""The agent's real transport (``nand.agent.transport.ServerSink``) against the
real server: hello with a token, events and heartbeats acked, stop received."""

from __future__ import annotations

import time

import httpx

from nand.agent import identity
from nand.agent.transport import server_sink as transport
from nand.events import Event, FlightWindow, StepSummary
from nand.server import embedded
from nand.server.settings import Settings


def test_server_sink_reports_a_fault_and_hears_the_stop(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    server = embedded.start(url, settings=Settings(db_url=url, token="tok"))
    sinks = []
    try:
        for rank in range(2):
            me = identity.Identity(
                run="sink", rank=rank, local_rank=rank, world_size=2, host="h", pid=100 + rank
            )
            sink = transport.ServerSink(server.zmq_endpoint, me, token="tok")
            sink.hello({"modules": [{"name": "fc", "type": "Linear"}], "optimizer": "SGD"})
            sink.heartbeat(StepSummary(step=5, steps_per_s=1.0, loss=0.5))
            sinks.append(sink)
        window = FlightWindow(steps=[4, 5], modules=["fc"], act_max_abs=[[1.0], [2.0]])
        sinks[1].event(
            Event(
                run="sink",
                rank=1,
                world_size=2,
                step=6,
                phase="forward",
                module="fc",
                module_type="Linear",
                nan=3,
            ),
            window,
        )
        sinks[0].event(
            Event(
                run="sink",
                rank=0,
                world_size=2,
                step=6,
                phase="grad",
                module="fc.weight",
                nan=3,
                cause="received",
            ),
            None,
        )
        for sink in sinks:
            assert sink.flush(10), sink.stats()
        verdict = httpx.get(f"{server.http_url}/api/runs/sink/verdict").json()
        assert verdict["origin"]["rank"] == 1 and verdict["ranks_received"] == [0]
        stop = httpx.post(
            f"{server.http_url}/api/runs/sink/stop", headers={"Authorization": "Bearer tok"}
        ).json()
        deadline = time.monotonic() + 10
        heard: list[dict] = []
        while time.monotonic() < deadline and not any(c.get("command") == "stop" for c in heard):
            heard += sinks[0].commands()
            time.sleep(0.05)
        assert {"command": "stop", "step": stop["step"]}.items() <= next(
            c for c in heard if c.get("command") == "stop"
        ).items()
    finally:
        for sink in sinks:
            sink.close(timeout=2)
        server.stop()
