"""The light mode's way out: an incident its replay cannot make exact is said
as such, and every module is probed from then on (``detect/tiers.py``)."""

from __future__ import annotations

import torch

import nand
from tests.agent.test_rerun import Streamed, batch


def test_a_light_replay_that_raises_says_what_was_checked_and_the_next_incident_is_exact():
    """The forward reads an iterator the step has spent: the replay raises.
    The first event is the light checks' (the root's output), says so, and
    the watch probes every module: the second incident names the layer."""
    model = Streamed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip", mode="light") as watch:
        for step in range(5):
            model.extra = iter([0.0 if step in (1, 3) else 1.0])  # log(0) at steps 1 and 3
            model(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first, second = watch.events
    assert (first.step, first.phase, first.module) == (1, "forward", "")
    assert first.replay.startswith("replay raised StopIteration")
    assert "light mode checked" in first.replay and "mode='full'" in first.replay
    assert (second.step, second.phase, second.module, second.cause) == (
        3, "forward", "log", "produced",
    )  # fmt: skip
    assert watch.step == 5


def test_a_light_incident_with_replays_off_is_not_exact_and_switches_to_the_full_mode(
    monkeypatch,
):
    monkeypatch.setenv("NAND_REPLAYS", "0")
    model = Streamed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip", mode="light") as watch:
        for step in range(5):
            model.extra = iter([0.0 if step in (1, 3) else 1.0])
            model(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first, second = watch.events
    assert (first.step, first.module) == (1, "")
    assert first.replay.startswith("not replayed: NAND_REPLAYS=0")
    assert (second.step, second.module, second.replay) == (3, "log", "")
