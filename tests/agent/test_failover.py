"""``NAND_SERVER`` with several servers: where each rank starts, and when it moves on
(real ``ServerSink``s against real ZeroMQ receivers on loopback)."""

from __future__ import annotations

import logging

import pytest

from nand.agent.identity import Identity
from nand.agent.transport.failover import Failover
from nand.agent.transport.server_sink import ServerSink
from nand.endpoints import agent_endpoints, split_list
from nand.errors import ConfigError
from nand.events import StepSummary
from nand.testing import Receiver, free_endpoint

FAST = {"ack_timeout_s": 0.3, "connect_grace_s": 0.1, "poll_interval_s": 0.02}


def _me(rank: int) -> Identity:
    return Identity(run="spread", rank=rank, local_rank=0, world_size=4, host="h", pid=1)


def _report(sink: ServerSink, steps: int) -> None:
    sink.hello({})
    for step in range(1, steps + 1):
        sink.heartbeat(StepSummary(step=step))


@pytest.fixture
def receivers():
    started = [Receiver().start(), Receiver().start()]
    yield started
    for receiver in started:
        receiver.close()


def test_each_rank_starts_at_the_server_its_rank_picks_and_stays_there(receivers, tmp_path):
    listed = ", ".join(r.endpoint for r in receivers)
    sinks = [ServerSink(listed, _me(rank), spool_dir=tmp_path, **FAST) for rank in range(4)]
    for sink in sinks:
        _report(sink, 3)
    assert all(sink.flush(10) for sink in sinks)
    for rank, sink in enumerate(sinks):
        assert receivers[rank % 2].seqs(sink.agent) == [1, 2, 3, 4]
        assert receivers[(rank + 1) % 2].seqs(sink.agent) == []
        assert "failovers" not in sink.stats()
        sink.close()


def test_a_rank_whose_server_is_down_moves_to_the_next_and_sends_everything_there(
    receivers, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="nand")
    dead = free_endpoint()
    sink = ServerSink(f"{dead},{receivers[0].endpoint}", _me(0), spool_dir=tmp_path, **FAST)
    _report(sink, 5)
    assert sink.flush(15), sink.stats()
    assert receivers[0].seqs(sink.agent) == [1, 2, 3, 4, 5, 6]
    assert sink.stats()["failovers"] == 1 and sink.dropped() == {}
    said = f"the server at {dead} does not answer; reporting to {receivers[0].endpoint} now"
    assert said in caplog.text
    sink.close()


def test_a_server_that_connects_but_never_acknowledges_is_left_for_the_next(receivers, tmp_path):
    silent = Receiver(answer=False).start()
    try:
        listed = f"{silent.endpoint} {receivers[1].endpoint}"
        sink = ServerSink(listed, _me(0), spool_dir=tmp_path, **FAST)
        _report(sink, 5)
        assert sink.flush(15), sink.stats()
        assert receivers[1].seqs(sink.agent) == [1, 2, 3, 4, 5, 6]
        assert sink.stats()["failovers"] == 1
        sink.close()
    finally:
        silent.close()


def test_a_rank_on_a_killed_server_moves_on_and_its_unacknowledged_messages_follow(
    receivers, tmp_path
):
    listed = ",".join(r.endpoint for r in receivers)
    sink = ServerSink(listed, _me(0), spool_dir=tmp_path, **FAST)
    _report(sink, 2)
    assert sink.flush(10)
    receivers[0].stop()  # the connection drops; nothing answers there any more
    for step in range(3, 8):
        sink.heartbeat(StepSummary(step=step))
    assert sink.flush(15), sink.stats()
    assert receivers[0].seqs(sink.agent)[:3] == [1, 2, 3]
    assert receivers[1].seqs(sink.agent) == [4, 5, 6, 7, 8]  # (3 was acknowledged before)
    sink.close()


def test_the_ranks_of_a_dead_server_spread_over_the_others_and_each_rank_tries_them_all() -> None:
    servers = ["tcp://a:1", "tcp://b:1", "tcp://c:1", "tcp://d:1"]
    on_a = [Failover(servers, rank=rank) for rank in range(0, 24, 4)]
    assert {f.current for f in on_a} == {"tcp://a:1"}
    moved = [f.advance() for f in on_a]
    assert sorted(moved) == [
        "tcp://b:1",
        "tcp://b:1",
        "tcp://c:1",
        "tcp://c:1",
        "tcp://d:1",
        "tcp://d:1",
    ]
    for failover in on_a:
        assert {failover.advance() for _ in servers} == set(servers)


def test_with_one_server_the_agent_never_moves_however_long_it_is_down() -> None:
    alone = Failover(["tcp://127.0.0.1:1"], rank=3, after_s=0.0)
    assert not alone.due(connected=False, ack_failures=99)
    assert alone.current == "tcp://127.0.0.1:1"


def test_a_list_with_a_bad_endpoint_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(ConfigError, match="'head-node:5557' is not like tcp://host:port"):
        ServerSink("tcp://a:5557,head-node:5557", _me(0), spool_dir=tmp_path)
    with pytest.raises(ConfigError, match="empty"):
        agent_endpoints(" , ")
    assert split_list("tcp://a:1,\n tcp://b:2  tcp://c:3,") == [
        "tcp://a:1",
        "tcp://b:2",
        "tcp://c:3",
    ]


def test_spool_replay_given_the_list_sends_to_its_first_server(receivers, tmp_path, capsys):
    from nand.agent.transport.spool import spool_path
    from nand.cli import main

    sink = ServerSink(free_endpoint(), _me(0), spool_dir=tmp_path, connect_grace_s=0.1)
    _report(sink, 2)
    sink.close(1.0)
    left = spool_path(tmp_path, "spread", 0)
    listed = f"{receivers[0].endpoint},{free_endpoint()}"
    assert main(["spool", "replay", str(left), "--server", listed, "--timeout", "10"]) == 0
    assert "3/3 acknowledged, done" in capsys.readouterr().out
    assert receivers[0].seqs(sink.agent) == [1, 2, 3]
