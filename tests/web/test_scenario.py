"""The dashboard's test runs: valid wire messages, and replaceable by a recording."""

from __future__ import annotations

from nand import wire
from nand.testing.receiver import Receiver
from tests.web import scenario


def test_every_scenario_message_passes_the_servers_wire_validation() -> None:
    for run in (scenario.diverged_run(), scenario.healthy_run(), scenario.wide_run(world_size=16)):
        for messages in run.messages.values():
            assert [m["seq"] for m in messages] == list(range(1, len(messages) + 1))
            for message in messages:
                wire.decode(wire.encode(message))


def test_a_run_recorded_by_the_test_receiver_replays_as_a_scenario() -> None:
    planted = scenario.diverged_run(world_size=3, origin_rank=1, bad_step=5)
    with Receiver() as rx:
        scenario.replay(rx.endpoint, planted)
        recorded = scenario.Scenario.recorded(rx.messages, planted.planted)
    assert recorded.run == planted.run and recorded.world_size == 3
    assert recorded.count() == planted.count()
    with Receiver() as rx:
        scenario.replay(rx.endpoint, recorded)
        assert rx.count("event") == 3 and rx.count("flight") == 1
