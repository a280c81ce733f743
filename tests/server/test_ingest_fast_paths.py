"""The ingest thread's shortcuts give what the long way gives: the heartbeat
decoder (``nand.server.agents.decoding``), the lag histogram filled a batch at a time
(``nand.server.observe``), the gradient-outlier test's plain steps
(``nand.server.analysis.outliers``) and many rows a statement (``nand.server.storage.bulk``)."""

from __future__ import annotations

import math
import sqlite3
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from nand import wire
from nand.errors import WireError
from nand.events import StepSummary
from nand.server.agents import decoding
from nand.server.analysis import outliers
from nand.server.metrics import LAG_BUCKETS
from nand.server.observe import observe_all
from nand.server.storage import bulk

MAX_BYTES = 4 * 1024 * 1024

odd = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
)
odd_or_list = (
    odd | st.lists(odd, max_size=3) | st.dictionaries(st.text(max_size=4), odd, max_size=2)
)


def heartbeat(**envelope: Any) -> dict[str, Any]:
    """A real agent's heartbeat (``ServerSink.heartbeat``): the summary, a loss count."""
    body = StepSummary(
        step=41,
        steps_per_s=12.5,
        loss=2.3,
        grad_norm=0.9,
        max_activation=30.0,
        amp_scale=65536.0,
        local_grad_norms=[(41, 0.7)],
    ).to_dict()
    body["dropped"] = {"queue_full": 3}
    message = wire.agent_message(
        "heartbeat", agent="a1b2c3d4", seq=7, run="run-1", rank=2, body=body
    )
    message.update(envelope)
    return message


def outcome(decode: Any, frame: bytes) -> Any:
    try:
        return ("accepted", msgpack.packb(decode(frame, MAX_BYTES)))  # (NaN == NaN here)
    except WireError as exc:
        return ("refused", exc.reason, str(exc))


ENVELOPE = ("v", "kind", "agent", "seq", "run", "rank", "time", "body")
BODY = (
    "step",
    "steps_per_s",
    "loss",
    "grad_norm",
    "max_activation",
    "amp_scale",
    "amp_skipped",
    "world_size",
    "pid",
    "dropped",
    "local_grad_norms",
    "event",
)


@settings(max_examples=600, deadline=None)
@given(
    where=st.sampled_from(["envelope", "body"]),
    key=st.sampled_from(ENVELOPE + BODY),
    value=odd_or_list,
    drop=st.booleans(),
)
def test_the_heartbeat_fast_path_accepts_and_refuses_exactly_what_the_full_checks_do(
    where: str, key: str, value: Any, drop: bool
) -> None:
    message = heartbeat()
    target = message if where == "envelope" else message["body"]
    if drop:
        target.pop(key, None)
    else:
        target[key] = value
    frame = msgpack.packb(message, use_bin_type=True)
    assert outcome(decoding.decode, frame) == outcome(decoding.checked, frame)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"agent": "a\x00b"},
        {"run": "r" * 300},
        {"seq": 2**63},
        {"rank": 2**31},
        {"rank": True},
        {"time": float("inf")},
        {"time": 12},
        {"v": 2},
        {"kind": "ack"},
    ],
)
def test_heartbeats_at_the_edges_are_decoded_as_the_full_checks_decode_them(
    change: dict[str, Any],
) -> None:
    frame = wire.encode(heartbeat(**change))
    assert outcome(decoding.decode, frame) == outcome(decoding.checked, frame)


@pytest.mark.parametrize(
    "body",
    [
        {"dropped": {"Queue": 1}},
        {"dropped": {"queue_full": -1}},
        {"dropped": {f"r{i}": 1 for i in range(wire.MAX_DROP_REASONS + 1)}},
        {"local_grad_norms": [[1, float("nan")]]},
        {"local_grad_norms": [[1, 2]]},
        {"local_grad_norms": [[-1, 2.0]]},
        {"local_grad_norms": [[1, 2.0]] * (wire.MAX_LOCAL_NORMS + 1)},
        {"step": 2**31},
        {"amp_skipped": 2**40},
        {"loss": True},
        {"event": {}},
    ],
)
def test_odd_heartbeat_bodies_get_the_full_checks_answer(body: dict[str, Any]) -> None:
    message = heartbeat()
    message["body"].update(body)
    frame = wire.encode(message)
    assert outcome(decoding.decode, frame) == outcome(decoding.checked, frame)


def test_a_real_agents_heartbeat_takes_the_fast_path() -> None:
    """Else the shortcut above would be tested but never taken."""
    frame = wire.encode(heartbeat())
    assert decoding._plain_heartbeat(msgpack.unpackb(frame, raw=False))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(LAG_BUCKETS)  # exactly on a bound: which bucket?
        | st.floats(min_value=0, max_value=1e6, allow_nan=False),
        max_size=50,
    )
)
def test_observing_a_batch_of_lags_at_once_gives_the_histogram_observing_each_gives(
    lags: list[float],
) -> None:
    one_by_one, at_once = CollectorRegistry(), CollectorRegistry()
    each = Histogram("lag", "lag", buckets=LAG_BUCKETS, registry=one_by_one)
    batch = Histogram("lag", "lag", buckets=LAG_BUCKETS, registry=at_once)
    for lag in lags:
        each.observe(lag)
    observe_all(batch, lags)
    assert samples(at_once) == samples(one_by_one)


def samples(registry: CollectorRegistry) -> list[str]:
    """The exposition's lines, but for when the histogram was made."""
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


# Just within and just beyond a factor of 10 of 1.0, where the shortcut must step aside.
norm = st.floats(min_value=0, max_value=1e30, allow_nan=False) | st.sampled_from(
    [0.0, 1.0, 10.0, 10.000001, 9.999999, 0.1, 0.0999999]
)


@settings(max_examples=500, deadline=None)
@example(norms={0: 1.0, 1: 1.0, 2: 1.0, 3: 10.000001}, factor=10.0)
@given(
    norms=st.dictionaries(st.integers(0, 63), norm, min_size=3, max_size=12),
    factor=st.sampled_from([1.0, 1.5, 10.0, 100.0, math.inf]),
)
def test_the_outlier_test_finds_the_same_ranks_with_and_without_its_shortcut(
    norms: dict[int, float], factor: float
) -> None:
    found = outliers.standing_out(norms, factor)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(outliers, "_within_factor", lambda *_: False)
        assert outliers.standing_out(norms, factor) == found


@pytest.mark.parametrize("extra", [-1, 0, 1, 7])
@pytest.mark.parametrize("statements", [0, 1, 3])
def test_rows_inserted_many_a_statement_are_the_rows_inserted_one_a_statement(
    tmp_path, statements: int, extra: int
) -> None:
    """Around each boundary of a full statement, with the real heartbeats
    table's columns (NULLs, floats, large integers) into a real SQLite file."""
    per = bulk.rows_per_statement(8)
    count = max(0, statements * per + extra)
    rows = [
        (1, i % 8, 1e9 + i, 2**40 + i, None if i % 5 == 0 else i / 3, 0.5, float(i), -1.0)
        for i in range(count)
    ]
    columns = "(run_id, rank, time, step, loss, grad_norm, steps_per_s, max_activation)"
    db = sqlite3.connect(tmp_path / "rows.db")
    for table in ("one", "many"):
        db.execute(
            f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, run_id, rank, time, step, "
            "loss, grad_norm, steps_per_s, max_activation)"
        )
    db.executemany(f"INSERT INTO one {columns} VALUES ({', '.join('?' * 8)})", rows)
    bulk.insert(db.executemany, f"INSERT INTO many {columns}", 8, rows)
    one = db.execute("SELECT * FROM one ORDER BY id").fetchall()
    assert db.execute("SELECT * FROM many ORDER BY id").fetchall() == one
    assert len(one) == count
