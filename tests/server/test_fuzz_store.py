"""Fuzzing the store's write paths with messages an agent could really send.

``test_fuzz.py`` throws anything at the decoder; most of it is refused, so
little reaches the tables. Here every message is valid by the wire's rules
(each kind's body built from the event model's own classes and enumerations,
its numbers and names out to the limits the wire and the columns allow), so
each must be decoded, stored, acknowledged and read back as it was sent:
events with their flight windows, flights, warnings, heartbeats, hellos,
fingerprints and byes, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from nand import wire
from nand.events import (
    CAUSES,
    DROP_REASONS,
    PHASES,
    VIA_FSDP_ALL_GATHER,
    VIA_GRAD_ALL_REDUCE,
    WARNING_KINDS,
    Alert,
    Event,
    FlightWindow,
    StepSummary,
)
from nand.runids import MAX_RUN_CHARS, run_flaw
from nand.server.agents.writer import write_batch
from nand.server.storage.bounds import INT32, INT64
from nand.server.storage.db import make_engine
from nand.server.storage.migrate import upgrade
from nand.server.storage.models import Agent, EventRow, Flight, Rank, Run, WarningRow
from nand.server.storage.sanitize import clean_str, out_of_range
from tests.server import pg

#: Counts and steps: small ones (the usual), and out to the column's limit.
counts = st.integers(0, 50) | st.integers(0, INT32)
big = st.integers(0, INT64)
floats = st.floats(allow_nan=True, allow_infinity=True)
finite = st.floats(allow_nan=False, allow_infinity=False)
maybe_float = st.none() | floats
#: Names as users and frameworks write them, any Unicode, NUL included (the
#: store drops it), up to the columns' length.
names = (
    st.sampled_from(["", "fc1", "model.layers.0.self_attn.q_proj", "é" * 300, "a\x00b"])
    | st.text(max_size=40)
    | st.text(st.characters(codec="utf-8"), min_size=500, max_size=512)
)
identifiers = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1)
run_ids = (
    st.sampled_from(["fz", "a b", "é-run", "50%", "a?b#c"])
    | identifiers.map(lambda s: s[: MAX_RUN_CHARS - 12])
).filter(lambda run: run_flaw(run) is None)


def matrix(rows: int, columns: int) -> st.SearchStrategy[list[list[float | None]]]:
    row = st.lists(maybe_float, min_size=columns, max_size=columns)
    return st.just([]) | st.lists(row, min_size=rows, max_size=rows)


@st.composite
def flights(draw: st.DrawFn) -> dict[str, Any]:
    steps = draw(st.lists(counts, max_size=4))
    modules = draw(st.lists(names, max_size=3))
    window = FlightWindow(
        steps=steps,
        modules=modules,
        act_max_abs=draw(matrix(len(steps), len(modules))),
        grad_max_abs=draw(matrix(len(steps), len(modules))),
        grad_norm=draw(st.lists(maybe_float, min_size=len(steps), max_size=len(steps))),
        loss=draw(st.lists(maybe_float, min_size=len(steps), max_size=len(steps))),
        dtype=draw(st.sampled_from(["", "float32", "bfloat16", "float16"])),
        dtype_max=draw(maybe_float),
    )
    return window.to_dict()


events = st.builds(
    Event,
    world_size=counts,
    host=names,
    pid=counts,
    step=counts,
    micro_step=counts,
    phase=st.sampled_from(PHASES),
    module=names,
    module_type=names,
    order=counts,
    cause=st.sampled_from(CAUSES),
    via=st.sampled_from(["", VIA_GRAD_ALL_REDUCE, VIA_FSDP_ALL_GATHER]) | names,
    nan=st.none() | big,
    posinf=st.none() | big,
    neginf=st.none() | big,
    min=maybe_float,
    max=maybe_float,
    max_abs=maybe_float,
    shape=st.lists(counts, max_size=4),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", ""]),
    time=finite,
    seq=big,
    call=counts,
    message=names,
    op=st.sampled_from(["", "aten::log", "aten::div.Tensor"]),
    source=names,
    reproduced=st.none() | st.booleans(),
    replay=names,
).map(Event.to_dict)

#: One strategy per kind an agent sends, each as the agent builds its body.
bodies: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "hello": st.fixed_dictionaries(
        {"world_size": counts, "host": names, "pid": counts},
        optional={
            "modules": st.lists(st.fixed_dictionaries({"name": names, "type": names})),
            "optimizer": st.none() | names,
            "versions": st.dictionaries(st.sampled_from(["nand", "torch", "cuda"]), names),
            "device": st.sampled_from(["cpu", "cuda:0"]),
            "launch": identifiers.map(lambda s: s[:200]),
        },
    ),
    "event": st.fixed_dictionaries({"event": events, "flight": st.none() | flights()}),
    "heartbeat": st.builds(
        StepSummary,
        step=counts,
        steps_per_s=maybe_float,
        loss=maybe_float,
        grad_norm=maybe_float,
        max_activation=maybe_float,
        amp_skipped=counts,
        amp_scale=maybe_float,
        local_grad_norms=st.none()
        | st.lists(st.tuples(counts, st.floats(0, 1e300)).map(list), max_size=4),
    )
    .map(StepSummary.to_dict)
    .flatmap(
        lambda body: (
            st.just(body)
            | st.dictionaries(st.sampled_from(DROP_REASONS), big, max_size=3).map(
                lambda dropped: {**body, "dropped": dropped}
            )
        )
    ),
    "flight": st.fixed_dictionaries({"flight": flights(), "reason": names}),
    "fingerprint": st.integers(0, 5).flatmap(
        lambda n: st.fixed_dictionaries(
            {
                "step": counts,
                "names": st.lists(names, min_size=n, max_size=n),
                "values": st.lists(st.integers(-INT64 - 1, INT64), min_size=n, max_size=n),
                "group": st.lists(st.integers(0, 2**31 - 1), max_size=3),
            }
        )
    ),
    "warning": st.builds(
        Alert,
        kind=st.sampled_from(WARNING_KINDS),
        step=counts,
        module=names,
        value=maybe_float,
        reference=maybe_float,
        message=names,
    ).map(lambda alert: {k: v for k, v in alert.to_dict().items() if k not in ("rank", "time")}),
    "bye": st.fixed_dictionaries({"step": counts, "reason": names}),
}
#: (kind, body, rank) of one valid message of any kind.
valid_messages = st.sampled_from(wire.AGENT_KINDS).flatmap(
    lambda kind: st.tuples(st.just(kind), bodies[kind], st.integers(0, 3))
)
batches = st.lists(valid_messages, min_size=1, max_size=12)


def test_every_kind_an_agent_sends_is_fuzzed():
    assert sorted(bodies) == sorted(wire.AGENT_KINDS)


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def engine(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'store.db'}"
        made = make_engine(url)
        upgrade(made)
        yield made
        made.dispose()
        return
    cluster: pg.Cluster = request.getfixturevalue("postgres")  # (fails on CI without it)
    with cluster.database() as url:
        made = make_engine(url)
        upgrade(made)
        yield made
        made.dispose()


#: Tells the examples' runs and agents apart in the one database.
_serial = itertools.count()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=batches, run=run_ids, agent=identifiers.map(lambda s: s[:100]))
def test_every_valid_message_is_stored_and_read_back_as_sent(
    engine: Engine, batch: list[tuple[str, dict[str, Any], int]], run: str, agent: str
) -> None:
    n = next(_serial)
    run, agent = f"{run}~{n}", f"{agent}~{n}"
    sent = []
    for seq, (kind, body, rank) in enumerate(batch, start=1):
        message = wire.agent_message(kind, agent=agent, seq=seq, run=run, rank=rank, body=body)
        decoded = wire.decode(wire.encode(message))  # valid: never refused
        assert out_of_range(decoded) is None, decoded
        sent.append(decoded)
    result = write_batch(engine, sent, time.time())
    assert result.acked == [(agent, m["seq"]) for m in sent]
    assert result.stored == len(sent) and result.kinds == Counter(m["kind"] for m in sent)
    with engine.connect() as conn:
        (run_id,) = conn.execute(select(Run.id).where(Run.name == run)).one()
        assert read_events(conn, run_id) == Counter(
            event_key(m["rank"], m["body"]["event"]) for m in sent if m["kind"] == "event"
        )
        windows = [m for m in sent if m["kind"] == "flight" or m["body"].get("flight")]
        assert read_flights(conn, run_id) == Counter(steps_of(m["body"]["flight"]) for m in windows)
        assert read_warnings(conn, run_id) == Counter(
            (m["rank"], m["body"]["step"], m["body"]["kind"])
            for m in sent
            if m["kind"] == "warning"
        )
        hellos = [m["rank"] for m in sent if m["kind"] == "hello"]
        agents = conn.execute(select(Agent.rank).where(Agent.run_id == run_id)).scalars()
        assert list(agents) == hellos[:1]  # (one row an agent: its first hello)
        byes = {m["rank"] for m in sent if m["kind"] == "bye"}
        finished = select(Rank.rank).where(Rank.run_id == run_id, Rank.finished_at.is_not(None))
        assert set(conn.execute(finished).scalars()) == byes


def event_key(rank: int, event: dict[str, Any]) -> tuple[Any, ...]:
    module = clean_str(event["module"], 512)
    return (rank, event["step"], event["micro_step"], event["phase"], module, event["cause"])


def steps_of(flight: dict[str, Any]) -> tuple[int, ...]:
    return tuple(flight["steps"])


def read_events(conn: Any, run_id: int) -> Counter[tuple[Any, ...]]:
    columns = (EventRow.rank, EventRow.step, EventRow.micro_step, EventRow.phase)
    rows = conn.execute(
        select(*columns, EventRow.module, EventRow.cause).where(EventRow.run_id == run_id)
    )
    return Counter(tuple(row) for row in rows)


def read_flights(conn: Any, run_id: int) -> Counter[tuple[int, ...]]:
    rows = conn.execute(select(Flight.data).where(Flight.run_id == run_id)).scalars()
    return Counter(tuple(data["steps"]) for data in rows)


def read_warnings(conn: Any, run_id: int) -> Counter[tuple[Any, ...]]:
    columns = (WarningRow.rank, WarningRow.step, WarningRow.kind)
    rows = conn.execute(select(*columns).where(WarningRow.run_id == run_id))
    return Counter(tuple(row) for row in rows)
