"""End to end in one process: ``nand.watch(..., server=...)`` talking to a real receiver."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nand
from nand.testing import Receiver


@pytest.fixture
def rx(monkeypatch):
    monkeypatch.setenv("NAND_HEARTBEAT_S", "0")  # a heartbeat at every step
    monkeypatch.setenv("NAND_RUN", "e2e-run")
    with Receiver() as receiver:
        yield receiver


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def test_watch_with_a_server_sends_hello_event_heartbeats_and_bye_in_order(rx):
    model, opt = _model()
    with nand.watch(model, optimizer=opt, server=rx.endpoint, log_events=False) as w:
        for step in range(6):
            x = torch.ones(3, 4)
            if step == 3:
                x[0, 0] = float("nan")
            _step(model, opt, x)
    assert w.first is not None
    assert rx.wait_for(lambda: rx.count("bye") == 1, timeout=10)
    (agent,) = rx.messages
    msgs = rx.messages[agent]
    assert [m["seq"] for m in msgs] == list(range(1, len(msgs) + 1))
    kinds = [m["kind"] for m in msgs]
    assert kinds[0] == "hello" and kinds[-1] == "bye" and "heartbeat" in kinds
    hello = msgs[0]["body"]
    assert (hello["run"], hello["rank"], hello["world_size"]) == ("e2e-run", 0, 1)
    assert {m["name"] for m in hello["modules"]} >= {"0", "2"}
    assert hello["versions"]["torch"] == torch.__version__
    first = next(m for m in msgs if m["kind"] == "event")["body"]
    assert first["event"]["step"] == 3 and first["event"]["phase"] == "input"
    assert first["flight"] is not None  # the flight window rides with the first incident
    beats = [m["body"]["step"] for m in msgs if m["kind"] == "heartbeat"]
    assert beats == sorted(beats) and beats[-1] >= 5


def test_a_stop_command_from_the_server_stops_training_at_that_step(rx):
    model, opt = _model()
    w = nand.watch(model, optimizer=opt, server=rx.endpoint, log_events=False)
    try:
        assert rx.wait_for(lambda: rx.count("hello") == 1, timeout=10)
        agent = rx.all("hello")[0]["agent"]
        rx.send_command(agent, {"command": "stop", "step": 30, "reason": "test"})
        with pytest.raises(nand.StopRequested) as info:
            for _ in range(200):
                _step(model, opt, torch.ones(3, 4))
                rx.wait_for(lambda: False, timeout=0.02)  # give the command time to arrive
        assert info.value.step == 30 and w.step == 30
    finally:
        w.close()


def test_the_launch_identity_rides_in_the_hello_and_is_left_out_when_unset(rx, monkeypatch):
    model, opt = _model()
    monkeypatch.setenv("NAND_LAUNCH", "job-uid-7")
    with nand.watch(model, optimizer=opt, server=rx.endpoint, log_events=False):
        _step(model, opt, torch.ones(3, 4))
    monkeypatch.delenv("NAND_LAUNCH")
    with nand.watch(model, optimizer=opt, server=rx.endpoint, log_events=False):
        _step(model, opt, torch.ones(3, 4))
    assert rx.wait_for(lambda: rx.count("bye") == 2, timeout=10)
    hellos = [m["body"] for msgs in rx.messages.values() for m in msgs if m["kind"] == "hello"]
    assert sorted(h.get("launch", "") for h in hellos) == ["", "job-uid-7"]
