"""The wire format: every field round-trips; bad frames fail with a stable reason."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nand import wire
from nand.errors import WireError
from nand.events import DROP_REASONS, Event, FlightWindow, StepSummary

FULL_EVENT = Event(
    run="run-1",
    rank=3,
    world_size=8,
    host="node-7",
    pid=4242,
    step=17,
    micro_step=2,
    phase="backward",
    module="encoder.layers.5.fc2",
    module_type="Linear",
    order=9,
    cause="produced",
    nan=3,
    posinf=1,
    neginf=2,
    min=-1.5,
    max=float("inf"),
    max_abs=float("nan"),
    shape=[4, 16],
    dtype="torch.float16",
    time=1700000000.25,
    seq=12,
    call=1,
    message="rank 3: NaN in backward",
)
FLIGHT = FlightWindow(
    steps=[15, 16],
    modules=["fc1", "fc2"],
    act_max_abs=[[1.0, None], [2.0, 65504.0]],
    grad_max_abs=[[0.5, 0.25], [None, float("inf")]],
    grad_norm=[1.0, None],
    loss=[2.5, 2.4],
    dtype="torch.float16",
    dtype_max=65504.0,
)


def _msg(kind: str, body: dict) -> bytes:
    return wire.encode(wire.agent_message(kind, agent="a1", seq=5, run="run-1", rank=3, body=body))


def _same(a: object, b: object) -> bool:
    """Equality that treats NaN as equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_event_with_flight_round_trips_every_field_including_nan_and_inf():
    decoded = wire.decode(
        _msg("event", {"event": FULL_EVENT.to_dict(), "flight": FLIGHT.to_dict()})
    )
    assert decoded["kind"] == "event" and decoded["v"] == wire.PROTOCOL_VERSION
    assert (decoded["agent"], decoded["seq"], decoded["run"], decoded["rank"]) == (
        "a1",
        5,
        "run-1",
        3,
    )
    assert _same(Event.from_dict(decoded["body"]["event"]).to_dict(), FULL_EVENT.to_dict())
    assert _same(FlightWindow.from_dict(decoded["body"]["flight"]).to_dict(), FLIGHT.to_dict())


def test_hello_heartbeat_flight_and_bye_round_trip():
    hello = {
        "run": "run-1",
        "rank": 3,
        "local_rank": 1,
        "world_size": 8,
        "host": "node-7",
        "pid": 4242,
        "versions": {"nand": "0.1.0", "torch": "2.13.0", "cuda": None},
        "device": "cpu",
        "modules": [{"name": "fc1", "type": "Linear", "params": 272, "order": 0}],
        "optimizer": "AdamW",
        "token": "s3cret",
    }
    summary = StepSummary(
        step=9,
        steps_per_s=3.5,
        loss=0.25,
        grad_norm=1.5,
        max_activation=7.0,
        amp_skipped=2,
        local_grad_norms=[[8, 1.25], [9, 0.0]],
    )
    cases = {
        "hello": hello,
        "heartbeat": {**summary.to_dict(), "dropped": {"queue_full": 3}},
        "flight": {"flight": FLIGHT.to_dict(), "reason": "server asked"},
        "bye": {"step": 100, "reason": "finished"},
    }
    for kind, body in cases.items():
        assert _same(wire.decode(_msg(kind, body))["body"], body), kind


def test_server_messages_round_trip_and_ack_may_name_its_agent():
    for message in (
        {"kind": "ack", "agent": "a1", "seqs": [1, 2, 3]},
        {"kind": "ack", "seqs": []},
        {"kind": "command", "command": "stop", "step": 40, "reason": "rank 3 went NaN"},
        {"kind": "command", "command": "send_flight"},
        {"kind": "reject", "reason": "bad token"},
    ):
        decoded = wire.decode(wire.encode(message))
        assert {k: v for k, v in decoded.items() if k != "v"} == message


def test_encode_turns_odd_values_into_text_instead_of_failing():
    class Dtype:
        def __str__(self) -> str:
            return "torch.bfloat16"

    body = {"world_size": 1, "host": "h", "pid": 1, "dtype": Dtype(), "tags": {"b", "a"}}
    decoded = wire.decode(_msg("hello", body))["body"]
    assert decoded["dtype"] == "torch.bfloat16" and decoded["tags"] == ["a", "b"]


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"\xc1", "not_msgpack"),
        (msgpack.packb([1, 2]), "not_a_map"),
        (msgpack.packb({"v": 99, "kind": "ack", "seqs": []}), "bad_version"),
        (msgpack.packb({"v": 1, "kind": "gossip"}), "unknown_kind"),
        (msgpack.packb({"v": 1, "kind": "ack"}), "missing_field"),
        (msgpack.packb({"v": 1, "kind": "ack", "seqs": [True]}), "bad_field"),
        (msgpack.packb({"v": 1, "kind": "ack", "agent": 7, "seqs": [1]}), "bad_field"),
        (msgpack.packb({"v": 1, "kind": "command", "command": "reboot"}), "bad_field"),
        (msgpack.packb({"v": 1, "kind": "command", "command": "stop"}), "missing_field"),
    ],
)
def test_malformed_frames_are_rejected_with_a_stable_reason(frame, reason):
    with pytest.raises(WireError) as info:
        wire.decode(frame)
    assert info.value.reason == reason


def test_agent_messages_with_bad_fields_say_which_field():
    bad_phase = {"event": {**FULL_EVENT.to_dict(), "phase": "sideways"}, "flight": None}
    with pytest.raises(WireError, match=r"event.phase"):
        wire.decode(_msg("event", bad_phase))
    bad_cause = {"event": {**FULL_EVENT.to_dict(), "cause": "cosmic rays"}, "flight": None}
    with pytest.raises(WireError, match=r"event.cause 'cosmic rays' not in"):
        wire.decode(_msg("event", bad_cause))
    ragged = {**FLIGHT.to_dict(), "act_max_abs": [[1.0]]}
    with pytest.raises(WireError, match=r"act_max_abs"):
        wire.decode(_msg("flight", {"flight": ragged, "reason": "x"}))
    with pytest.raises(WireError, match=r"hello.host"):
        wire.decode(_msg("hello", {"world_size": 1, "pid": 1}))
    negative = wire.agent_message("bye", agent="a", seq=-1, run="r", rank=0, body={"step": 1})
    with pytest.raises(WireError, match=r"message.seq is negative"):
        wire.decode(wire.encode(negative))


@pytest.mark.parametrize(
    ("pairs", "says"),
    [
        ([[1, 2.0]] * (wire.MAX_LOCAL_NORMS + 1), "over 256"),
        ([[1, float("nan")]], "not finite"),
        ([[1, -1.0]], "not finite"),
        ([[-1, 1.0]], r"\[\[step, norm\]"),
        ([[1, True]], r"\[\[step, norm\]"),
        ([[1, 2.0, 3.0]], r"\[\[step, norm\]"),
        ([5], r"\[\[step, norm\]"),
    ],
)
def test_a_heartbeats_local_gradient_norms_must_be_step_norm_pairs(pairs, says):
    body = {**StepSummary(step=1).to_dict(), "local_grad_norms": pairs}
    with pytest.raises(WireError, match=f"heartbeat.local_grad_norms: .*{says}"):
        wire.decode(_msg("heartbeat", body))


def test_a_heartbeat_carries_every_drop_reason_and_newer_ones_if_they_are_identifiers():
    dropped = {reason: 2**63 - 1 - i for i, reason in enumerate(DROP_REASONS)}
    dropped["from_a_newer_agent"] = 0
    body = {**StepSummary(step=1).to_dict(), "dropped": dropped}
    assert wire.decode(_msg("heartbeat", body))["body"]["dropped"] == dropped
    assert "dropped" not in wire.decode(_msg("heartbeat", StepSummary(step=1).to_dict()))["body"]


@pytest.mark.parametrize(
    ("dropped", "says"),
    [
        ({"spool_full": -1}, r"heartbeat.dropped\['spool_full'\] is negative"),
        ({"spool_full": 2.0}, r"is float, not int"),
        ({"spool_full": False}, r"is bool, not int"),
        ({"spool_full": None}, r"is NoneType, not int"),
        ({"spool_full": 2**64 - 1}, r"beyond 2\*\*63 - 1"),
        ({"Spool": 1}, r"reason 'Spool' is not a short identifier"),
        ({"": 1}, r"reason '' is not a short identifier"),
        ({b"spool_full": 1}, r"reason b'spool_full' is not a short identifier"),
        ({f"r{i}": 1 for i in range(33)}, r"has 33 reasons > 32"),
        ([1, 2], r"heartbeat.dropped is list, expected dict"),
    ],
)
def test_malformed_drop_counts_are_a_bad_field_that_names_the_entry(dropped, says):
    body = {**StepSummary(step=1).to_dict(), "dropped": dropped}
    with pytest.raises(WireError, match=says) as info:
        wire.decode(_msg("heartbeat", body))
    assert info.value.reason == "bad_field"


def test_oversized_frames_are_rejected_unread():
    frame = _msg("bye", {"step": 1, "reason": "x" * 2000})
    with pytest.raises(WireError) as info:
        wire.decode(frame, max_bytes=1000)
    assert info.value.reason == "too_large"
    assert wire.decode(frame, max_bytes=len(frame))["kind"] == "bye"


_leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decoding_random_bytes_raises_nothing_but_wire_error(frame):
    try:
        wire.decode(frame)
    except WireError as exc:
        assert exc.reason in wire.REASONS


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted({*wire.AGENT_KINDS, *wire.SERVER_KINDS})),
    st.dictionaries(
        st.sampled_from(["agent", "seq", "run", "rank", "time", "body", "seqs", "command", "step"]),
        _values,
    ),
)
def test_decoding_structured_garbage_raises_nothing_but_wire_error(kind, fields):
    try:
        wire.decode(wire.encode({"v": 1, "kind": kind, **fields}))
    except WireError as exc:
        assert exc.reason in wire.REASONS


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0))
def test_corrupting_a_valid_frame_raises_nothing_but_wire_error(junk, where):
    frame = bytearray(_msg("event", {"event": FULL_EVENT.to_dict(), "flight": FLIGHT.to_dict()}))
    where %= len(frame)
    frame[where : where + len(junk)] = junk
    try:
        wire.decode(bytes(frame))
    except WireError as exc:
        assert exc.reason in wire.REASONS


def test_a_fingerprint_names_its_replica_group_with_a_few_mesh_coordinates():
    body = {"step": 5, "names": ["w", "w:exp_avg"], "values": [3, -(2**63)], "group": [1, 0]}
    assert wire.decode(_msg("fingerprint", body))["body"] == body
    without = {k: v for k, v in body.items() if k != "group"}  # (DDP: every rank)
    assert wire.decode(_msg("fingerprint", without))["body"] == without
    for group in ([-1], [True], ["1"], list(range(wire.MAX_MESH_DIMS + 1))):
        with pytest.raises(WireError, match=r"fingerprint\.group"):
            wire.decode(_msg("fingerprint", {**body, "group": group}))
