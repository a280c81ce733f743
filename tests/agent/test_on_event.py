"""``nand.watch(..., on_event=fn)``: every incident and early warning, to the user's code.

The ground truth is the loop's own: which batch was poisoned, which step's
loss spiked (computed here without nand), and what nand's JSONL file holds,
which ``on_event`` must agree with report for report.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nand
from nand.errors import ConfigError

SPIKE, POISONED, STEPS = 30, 35, 40


def train(tmp_path, on_event, poisoned=(POISONED,), spike=SPIKE) -> tuple[nand.Watch, list[float]]:
    """A small transformer: labels off by 30x at ``spike``, a NaN in the input at ``poisoned``."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    losses = []
    events_file = str(tmp_path / "events.jsonl")
    with nand.watch(model, opt, events_file=events_file, on_event=on_event) as watch:
        for step in range(STEPS):
            batch = x.clone()
            if step in poisoned:
                batch[0, 0, 0] = float("nan")
            loss = F.mse_loss(model(batch), y * 30 if step == spike else y)
            watch.loss(loss)
            losses.append(loss.item())
            loss.backward()
            if step in poisoned:
                opt.zero_grad()  # (the NaN is reported; the weights stay finite for what follows)
            opt.step()
            opt.zero_grad()
    return watch, losses


def from_file(tmp_path) -> list[tuple[str, int]]:
    """What nand's JSONL file says happened: (kind or phase, step), in order."""
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    said = []
    for line in lines:
        if line["type"] == "event":
            said.append((line["event"]["phase"], line["event"]["step"]))
        elif line["type"] == "warning":
            said.append((line["warning"]["kind"], line["warning"]["step"]))
    return said


def test_on_event_gets_every_incident_and_warning_the_log_gets_as_event_and_alert(tmp_path):
    got: list[nand.Event | nand.Alert] = []
    watch, losses = train(tmp_path, got.append)
    spikes = [s for s in range(20, STEPS) if losses[s] > 3 * sum(losses[s - 20 : s]) / 20]
    assert spikes == [SPIKE]  # the truth, without nand
    incidents = [r for r in got if isinstance(r, nand.Event)]
    warnings = [r for r in got if isinstance(r, nand.Alert)]
    assert [(e.step, e.phase, e.cause) for e in incidents] == [(POISONED, "input", "data")]
    assert incidents[0] == watch.first
    assert ("loss_spike", SPIKE) in [(w.kind, w.step) for w in warnings]
    as_given = [(r.phase, r.step) if isinstance(r, nand.Event) else (r.kind, r.step) for r in got]
    assert as_given == from_file(tmp_path)


@pytest.mark.nand_internal_error_expected  # (the user's callback fails, with its traceback)
def test_an_on_event_that_raises_is_logged_once_and_training_and_the_others_go_on(tmp_path, caplog):
    def broken(report: object) -> None:
        raise RuntimeError("the pager is down")

    got: list[object] = []
    with caplog.at_level(logging.ERROR, logger="nand"):
        watch, losses = train(tmp_path, [broken, got.append], poisoned=(5, 12))
    assert len(losses) == STEPS and watch.step == STEPS  # training went on to the end
    assert [e.step for e in watch.events] == [5, 12]
    assert [r.step for r in got if isinstance(r, nand.Event)] == [5, 12]  # (called after it)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "on_event" in errors[0].getMessage() and errors[0].exc_info[1].args == (
        "the pager is down",
    )


def test_a_bad_on_event_is_refused_by_name_before_anything_is_hooked():
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="on_event takes a callable"):
        nand.watch(model, on_event=[print, 42])
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_nand_disable_calls_no_on_event(tmp_path, monkeypatch):
    monkeypatch.setenv("NAND_DISABLE", "1")
    got: list[object] = []
    watch, _ = train(tmp_path, got.append)
    assert got == [] and watch.first is None
