"""warn / raise / skip / stop, server commands, and what the sinks are told."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import nand
from nand.agent.output.session import Session
from nand.agent.output.sinks import JsonlSink, LogSink
from nand.agent.watch import Watch
from nand.config import AgentConfig
from tests.agent.models import VALUES, mlp, train

pytestmark = pytest.mark.parametrize("kind", list(VALUES))


class RecordingSink:
    """A Sink that records every call; commands are queued by the test."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.queued: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, args))

    def commands(self) -> list[dict[str, Any]]:
        out, self.queued = self.queued, []
        return out

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args in self.calls if n == name]


def watch_with(sink: RecordingSink, model, opt, **kwargs) -> Watch:
    w = nand.watch(model, opt, log_events=False, **kwargs)
    w.session.add_sink(sink)
    return w


def bad_grad_at(model, step_to_break: int, value: float):
    def loss_fn(out, step):
        loss = out.pow(2).mean()
        return loss * value if step == step_to_break else loss

    return loss_fn


def test_raise_stops_before_the_update_so_the_weights_stay_finite(kind):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with (
        nand.watch(model, opt, on_nonfinite="raise") as w,
        pytest.raises(nand.NonFiniteError) as info,
    ):
        train(model, opt, 6, loss_fn=bad_grad_at(model, 3, VALUES[kind]))
    assert (info.value.event.step, info.value.event.phase) == (3, "loss")
    assert w.step == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_drops_the_bad_step_and_training_goes_on(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with nand.watch(model, opt, on_nonfinite="skip") as w:
        train(model, opt, 8, loss_fn=bad_grad_at(model, 3, VALUES[kind]))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert w.step == 8 and w.first.step == 3 and len(w.events) == 1


def test_stop_in_a_single_process_raises_like_raise(kind):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="stop"), pytest.raises(nand.NonFiniteError):
        train(model, opt, 6, loss_fn=bad_grad_at(model, 2, VALUES[kind]))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_warn_logs_one_message_per_incident_not_one_per_step(kind, caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    caplog.set_level(logging.WARNING, logger="nand")
    with nand.watch(model, opt) as w:  # warn: the NaN goes into the weights, every step is bad
        train(model, opt, 10, loss_fn=bad_grad_at(model, 4, VALUES[kind]))
    messages = [r.getMessage() for r in caplog.records if r.name == "nand"]
    assert len(messages) == 1 and "step 4" in messages[0] and "loss" in messages[0]
    assert w.nonfinite_steps >= 5 and len(w.events) == 1


def test_sinks_get_hello_first_event_with_flight_and_bye(kind):
    sink = RecordingSink()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch_with(sink, model, opt, on_nonfinite="skip") as w:
        train(model, opt, 5, loss_fn=bad_grad_at(model, 3, VALUES[kind]))
    names = [n for n, _ in sink.calls]
    assert names[-2:] == ["bye", "close"] and names.count("event") == 1
    event, flight = sink.named("event")[0]
    assert event.step == 3 and flight.steps[-1] == 3 and len(flight.steps) == 4
    assert flight.modules[:2] == ["", "0"]
    if w.settings.mode == "full":  # a row per layer
        assert flight.act_max_abs[0][1] > 0
    else:  # the model's own output, and a rotating sample of its layers (README,
        # "Light mode"): one of the MLP's three Linears a step, never a ReLU
        assert flight.act_max_abs[0][0] > 0
        for row in flight.act_max_abs:
            sampled = {flight.modules[i] for i, v in enumerate(row) if i and v is not None}
            assert len(sampled) == 1 and sampled <= {"0", "2", "4"}, row
    assert sink.named("bye")[0] == (5, "closed")


def test_hello_describes_identity_versions_modules_and_optimizer(kind):
    sink = RecordingSink()
    settings = AgentConfig(run="run-x", log_events=False, flight_steps=4, max_events=10)
    session = Session.open(settings)
    session.add_sink(sink)
    model = mlp()
    Watch(model, torch.optim.Adam(model.parameters()), settings=settings, session=session).close()
    info = sink.named("hello")[0][0]
    assert info["run"] == "run-x" and info["rank"] == 0 and info["optimizer"] == "Adam"
    assert info["versions"]["nand"] == nand.__version__ and info["device"] == "cpu"
    assert info["modules"][1] == {"name": "0", "type": "Linear", "order": 1, "params": 8 * 16 + 16}


def test_a_stop_command_raises_stop_requested_at_the_asked_step(kind):
    sink = RecordingSink()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink.queued.append({"command": "stop", "step": 4})
    with watch_with(sink, model, opt) as w, pytest.raises(nand.StopRequested) as info:
        train(model, opt, 10)
    assert info.value.step == 4 and w.step == 4


def test_a_send_flight_command_sends_the_window(kind):
    sink = RecordingSink()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch_with(sink, model, opt, flight_steps=3):
        train(model, opt, 2)
        sink.queued.append({"command": "send_flight"})
        train(model, opt, 3)
    flight, reason = sink.named("flight")[0]
    assert reason == "requested" and len(flight.steps) == 3


def test_heartbeats_carry_figures_already_read(kind, monkeypatch):
    monkeypatch.setenv("NAND_HEARTBEAT_S", "0")
    sink = RecordingSink()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch_with(sink, model, opt) as w:
        for _ in range(3):
            w.loss(model(torch.randn(4, 8)).pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
    beats = [args[0] for args in sink.named("heartbeat")]
    assert len(beats) == 3 and beats[-1].step == 2
    assert beats[-1].loss > 0 and beats[-1].grad_norm > 0 and beats[-1].max_activation > 0


def test_without_a_server_no_sink_is_called_per_step(kind, monkeypatch, tmp_path):
    # Heartbeats and command polls are for a server: local sinks are spared them.
    monkeypatch.setenv("NAND_HEARTBEAT_S", "0")
    calls: list[str] = []
    for local in (LogSink, JsonlSink):
        monkeypatch.setattr(local, "commands", lambda self: calls.append("commands") or [])
        monkeypatch.setattr(local, "heartbeat", lambda self, summary: calls.append("beat"))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, events_file=str(tmp_path / "events.jsonl")) as w:
        train(model, opt, 3)
    assert len(w.session.sinks) == 2 and calls == []


def test_stop_with_on_stop_skips_the_update_and_asks_the_loop_to_end_instead_of_raising(kind):
    model = mlp(plant_after=4)  # (last: a -inf before a ReLU never reaches the step's figures)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    asked, after = [], []
    opt.register_step_post_hook(lambda *_: after.append([p.clone() for p in model.parameters()]))
    with nand.watch(model, opt, on_nonfinite="stop", on_stop=lambda: asked.append(1)) as w:
        for step in range(4):
            model[5].value = VALUES[kind] if step >= 2 else None
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()  # no exception: the framework's loop is asked to stop
            opt.zero_grad()
    assert asked == [1]  # once, however many bad steps follow
    assert w.first.step == 2 and w.step == 4
    for bad in (2, 3):  # those updates were dropped
        assert all(torch.equal(a, b) for a, b in zip(after[bad - 1], after[bad], strict=True))
