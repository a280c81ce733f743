"""Messages an agent lost are visible (issue 20): the real agent transport, made
to lose messages for real (its hand-off queue overflows; a frame over its size
limit), reports them in its heartbeats, and a real server process shows them
per rank in REST and in ``/metrics``."""

from __future__ import annotations

import time

import httpx

from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.events import FlightWindow, StepSummary
from tests.server.processes import ServerProcess, free_port

FAST = {"ack_timeout_s": 0.3, "connect_grace_s": 0.1, "poll_interval_s": 0.02}


def lossy_agent(endpoint: str, run: str, rank: int, token: str | None = None) -> dict[str, int]:
    """An agent that loses messages the way a busy one does; returns its own count."""
    me = Identity(run=run, rank=rank, local_rank=rank, world_size=2, host="h", pid=100 + rank)
    sink = ServerSink(endpoint, me, token=token, queue_max=5, max_frame_bytes=4096, **FAST)
    sink.hello({"modules": [{"name": "fc", "type": "Linear"}]})
    big = FlightWindow(steps=list(range(2000)), modules=["fc"], act_max_abs=[[1.5]] * 2000)
    sink.flight(big, "asked")  # over max_frame_bytes: too_large
    for step in range(300):  # faster than the sender takes them: queue_full
        sink.heartbeat(StepSummary(step=step))
    time.sleep(0.5)
    sink.heartbeat(StepSummary(step=300))  # carries the counts
    assert sink.flush(10), sink.stats()
    lost = sink.dropped()
    sink.close()
    return lost


def test_each_rank_shows_what_its_agent_dropped_and_why_in_rest_and_metrics(tmp_path) -> None:
    port = free_port()
    server = ServerProcess(f"sqlite:///{tmp_path / 'n.db'}", port).start()
    try:
        lost = lossy_agent(server.zmq_endpoint, "gappy", rank=1)
        assert lost["queue_full"] > 0 and lost["too_large"] == 1
        clean = Identity(run="gappy", rank=0, local_rank=0, world_size=2, host="h", pid=1)
        sink = ServerSink(server.zmq_endpoint, clean, **FAST)
        sink.hello({})
        sink.heartbeat(StepSummary(step=300))
        assert sink.flush(10)
        sink.close()
        ranks = httpx.get(f"{server.http_url}/api/runs/gappy/ranks").json()
        by_rank = {r["rank"]: r for r in ranks}
        assert by_rank[1]["dropped"] == lost
        assert by_rank[1]["dropped_total"] == sum(lost.values())
        assert by_rank[0]["dropped"] == {} and by_rank[0]["dropped_total"] == 0
        metrics = httpx.get(f"{server.http_url}/metrics").text
        line = f'nand_agent_dropped_messages{{reason="queue_full"}} {float(lost["queue_full"])}'
        assert line in metrics
        assert 'nand_agent_dropped_messages{reason="too_large"} 1.0' in metrics
        assert 'nand_agent_dropped_messages{reason="disk_full"} 0.0' in metrics
    finally:
        server.stop()
