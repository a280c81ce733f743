"""What a rank's policy (``StepPolicy``) does with what the ranks' agreement
hands it: the all-reduced "anything non-finite" flag (``Outcome.any_rank_bad``)
and this rank's own event, if any. The multi-rank tests (torchrun, gloo) run it
with a second rank; here the same inputs are given in one process, and the
expected action is the contract of ``nand/agent/step/policy.py``."""

from __future__ import annotations

import logging

import pytest

from nand.agent.step.policy import StepPolicy
from nand.agent.step.window import Outcome
from nand.errors import NonFiniteError, StopRequested
from nand.events import Event
from nand.policy import OnNonfinite


def stop_policy(policy: str, dropped: list[int], on_stop=None) -> StepPolicy:
    return StepPolicy(OnNonfinite(policy), drop_grads=lambda: dropped.append(1), on_stop=on_stop)


@pytest.mark.parametrize("policy", ["stop", "raise"])
def test_a_rank_that_saw_nothing_stops_with_stop_requested_when_another_rank_went_bad(policy):
    with pytest.raises(StopRequested) as info:
        stop_policy(policy, []).act(Outcome(any_rank_bad=True), 7)
    assert info.value.step == 7
    assert str(info.value) == "stop requested at step 7: a non-finite value on another rank"


def test_a_rank_that_only_received_the_value_stops_with_stop_requested_not_its_own_error():
    received = Event(step=3, phase="grad", cause="received", module="fc1")
    with pytest.raises(StopRequested) as info:
        stop_policy("stop", []).act(Outcome(event=received, any_rank_bad=True), 3)
    assert info.value.step == 3
    made = Event(step=3, phase="grad", cause="produced", module="fc1")
    with pytest.raises(NonFiniteError) as raised:
        stop_policy("stop", []).act(Outcome(event=made, any_rank_bad=True), 3)
    assert raised.value.event is made


def test_with_on_stop_a_rank_that_saw_nothing_drops_each_update_and_asks_once():
    dropped: list[int] = []
    asked: list[int] = []
    policy = stop_policy("stop", dropped, on_stop=lambda: asked.append(1))
    policy.act(Outcome(any_rank_bad=True), 4)
    policy.act(Outcome(any_rank_bad=True), 5)
    assert dropped == [1, 1] and asked == [1]


def test_skip_drops_the_update_when_only_another_rank_went_bad(caplog):
    dropped: list[int] = []
    with caplog.at_level(logging.WARNING, logger="nand"):
        stop_policy("skip", dropped).act(Outcome(any_rank_bad=True), 9)
    assert dropped == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "nand: skipped optimizer step 9 (non-finite)"
    ]
