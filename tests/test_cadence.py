"""A big job's ranks report less often (``nand.cadence``), and the agent and the
server read the same rule: the agent's heartbeat period and keepalive, the
server's lost and stalled thresholds.

    python -m pytest tests/test_cadence.py -q
"""

from __future__ import annotations

import pytest

from nand import cadence
from nand.agent.identity import Identity
from nand.agent.output.session import Session
from nand.agent.output.sinks import server_sink
from nand.config import AgentConfig, TransportConfig
from nand.server.settings import Settings
from nand.testing import free_port


def _who(world: int) -> Identity:
    return Identity(run="r", rank=0, local_rank=0, world_size=world, host="h", pid=1)


@pytest.mark.parametrize("world", [1, 8, 10_000, 20_000, 100_000])
def test_the_agent_beats_at_the_period_the_server_expects_of_a_job_that_size(world) -> None:
    agent = Session(_who(world), [], AgentConfig(heartbeat_s=5.0))
    server = Settings(heartbeat_s=5.0).for_world(world)
    assert agent.heartbeat_s == server.heartbeat_s == cadence.heartbeat_s(5.0, world)
    # The job's heartbeats stay within the budget, however many ranks it has.
    assert world / agent.heartbeat_s <= max(cadence.JOB_HEARTBEATS_PER_S, world / 5.0)


def test_a_100000_rank_jobs_rank_beats_every_50_s_and_is_lost_after_600_s() -> None:
    settings = Settings(heartbeat_s=5.0, lost_after_s=60.0, stalled_after_s=300.0)
    big = settings.for_world(100_000)
    assert (big.heartbeat_s, big.lost_after_s, big.stalled_after_s) == (50.0, 600.0, 3000.0)
    assert settings.for_world(10_000) is settings


def test_the_agents_keepalive_stretches_with_its_heartbeat(tmp_path) -> None:
    transport = TransportConfig(spool_dir=tmp_path, keepalive_s=10.0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sinks = [server_sink(endpoint, _who(world), transport) for world in (8, 100_000)]
    try:
        assert [s.settings.keepalive_s for s in sinks] == [10.0, 100.0]
    finally:
        for sink in sinks:
            sink.close(timeout=0.1)
