"""How the writer stores each kind of agent message: one handler per kind (a
kind may have several), run in the order of :data:`UNLOCKED`, then the writer
touches the runs and takes their lock (:mod:`nand.server.storage.runlock`),
then :data:`LOCKED`: the handlers that compare a step across ranks.

The kinds are the wire's (:data:`nand.wire.kinds.KINDS`, whose ``stored_in``
names the tables each lands in); ``tests/test_wire_kinds.py`` holds every agent
kind to a handler here. A new kind is a row there and a handler here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, bindparam, case, insert, select, tuple_
from sqlalchemy import update as sql_update

from nand.server.agents import rows as build
from nand.server.analysis import alerts, losses, outliers, replicas
from nand.server.analysis import firsts as firsts_mod
from nand.server.storage import bulk
from nand.server.storage.db import insert_ignoring_conflicts
from nand.server.storage.models import Agent, EventRow, Flight, Heartbeat, Rank, Run
from nand.server.storage.runids import RunIds
from nand.server.storage.sanitize import clean_str


@dataclass
class Batch:
    """What every handler of one batch shares: its connection, ids and clock."""

    conn: Connection
    run_ids: RunIds
    #: ``(run id, rank) -> ranks.id`` for every rank in the batch.
    rank_ids: dict[tuple[int, int], int]
    now: float
    grad_outlier_factor: float
    #: The loss counts committed before (see ``writer.write_batch``).
    drops: losses.Committed | None
    #: The drop rows written (``losses.store``), told to ``drops`` after the commit.
    written: list[dict[str, Any]] = field(default_factory=list)


#: A handler: store the batch's messages of one kind.
Store = Callable[[Batch, list[dict[str, Any]]], None]


def insert_rows(
    conn: Connection, table: Any, columns: tuple[str, ...], rows: list[tuple[Any, ...]]
) -> None:
    """A fast executemany of ``rows`` (tuples in the order of ``columns``): on
    SQLite straight to the driver, many rows a statement (:mod:`bulk`; no
    per-row SQLAlchemy parameter processing: the columns here need none, and no
    dict is built per row); elsewhere SQLAlchemy's batched multi-row INSERT."""
    if conn.dialect.name != "sqlite":
        conn.execute(insert(table), [dict(zip(columns, row, strict=True)) for row in rows])
        return
    head = f"INSERT INTO {table.__tablename__} ({', '.join(columns)})"
    bulk.insert(conn.exec_driver_sql, head, len(columns), rows)  # (many rows a statement)


def _rank_key(message: dict[str, Any], run_ids: RunIds) -> tuple[int, int]:
    return run_ids.of(message), message["rank"]


def ensure_ranks(
    conn: Connection, fresh: list[dict[str, Any]], run_ids: RunIds, now: float
) -> dict[tuple[int, int], int]:
    keys = run_ids.rank_keys(fresh)
    rows = [
        {"run_id": r, "rank": k, "first_seen": now, "last_seen": now, "step_changed_at": now}
        for r, k in keys
    ]
    conn.execute(insert_ignoring_conflicts(conn, Rank), rows)
    found = conn.execute(
        select(Rank.run_id, Rank.rank, Rank.id).where(
            tuple_(Rank.run_id, Rank.rank).in_(list(keys))
        )
    )
    ids = {(run_id, rank): rank_id for run_id, rank, rank_id in found}
    conn.execute(
        sql_update(Rank)
        .where(Rank.id == bindparam("rid"))
        .values(last_seen=_greatest(Rank.last_seen, "now")),
        [{"rid": rank_id, "now": now} for rank_id in sorted(ids.values())],  # one lock order
    )
    return ids


def _greatest(column: Any, param: str) -> Any:
    """Portable GREATEST(column, :param)."""
    value: Any = bindparam(param)
    return case((column < value, value), else_=column)


def hellos(batch: Batch, messages: list[dict[str, Any]]) -> None:
    """A rank's identity (host, pid, device), its agent, the run's modules and versions."""
    conn, run_ids, rank_ids = batch.conn, batch.run_ids, batch.rank_ids
    for message in messages:
        body = message["body"]
        run_id, rank_id = run_ids.of(message), rank_ids[_rank_key(message, run_ids)]
        conn.execute(
            sql_update(Rank)
            .where(Rank.id == rank_id)
            .values(
                host=clean_str(body["host"], 256),
                pid=body["pid"],
                world_size=body["world_size"],
                device=clean_str(body.get("device"), 64),
            )
        )
        conn.execute(insert_ignoring_conflicts(conn, Agent), [build.agent_row(message, run_id)])
        info = build.run_info(body)
        if info:
            conn.execute(sql_update(Run).where(Run.id == run_id).values(**info))


def heartbeats(batch: Batch, beats: list[dict[str, Any]]) -> None:
    """The telemetry rows, and each rank's progress (its step, rate, loss...)."""
    conn, run_ids, rank_ids, now = batch.conn, batch.run_ids, batch.rank_ids, batch.now
    if not beats:
        return
    rows = [build.heartbeat_values(m, run_ids.of(m)) for m in beats]
    insert_rows(conn, Heartbeat, build.HEARTBEAT_COLUMNS, rows)
    # Each rank's progress is its heartbeat with the highest step (the last of
    # equals): one row a rank, picked before any dict is built.
    latest: dict[int, int] = {}
    step = build.HEARTBEAT_COLUMNS.index("step")
    for i, row in enumerate(rows):
        rank_id = rank_ids[(row[0], row[1])]
        if rank_id not in latest or rows[latest[rank_id]][step] <= row[step]:
            latest[rank_id] = i
    conn.execute(
        _RANK_PROGRESS,
        [build.progress_params(r, rows[i], beats[i], now) for r, i in latest.items()],
    )


_RANK_PROGRESS = (
    sql_update(Rank)
    .where(Rank.id == bindparam("rid"))
    .values(
        step_changed_at=case(
            (Rank.step < bindparam("hb_step"), bindparam("now")), else_=Rank.step_changed_at
        ),
        step=_greatest(Rank.step, "hb_step"),
        steps_per_s=bindparam("hb_sps"),
        loss=bindparam("hb_loss"),
        grad_norm=bindparam("hb_gn"),
        max_activation=bindparam("hb_act"),
        amp_skipped=bindparam("hb_amp"),
    )
)


def events(batch: Batch, messages: list[dict[str, Any]]) -> None:
    """The events, each rank's cached first one, and the windows that came with them."""
    conn, run_ids, rank_ids = batch.conn, batch.run_ids, batch.rank_ids
    if not messages:
        return
    rows = [build.event_row(m, run_ids) for m in messages]
    conn.execute(insert(EventRow), rows)  # a plain executemany: no RETURNING
    firsts: dict[int, dict[str, Any]] = {}
    for message, row in zip(messages, rows, strict=True):
        rank_id = rank_ids[_rank_key(message, run_ids)]
        if rank_id not in firsts or build.logical_key(row) < build.logical_key(firsts[rank_id]):
            firsts[rank_id] = row
    firsts_mod.update_firsts(
        conn,
        {
            rank_id: (build.logical_key(row), firsts_mod.event_id(conn, row))
            for rank_id, row in firsts.items()
        },
    )
    flights(batch, [m for m in messages if m["body"].get("flight")])


def flights(batch: Batch, messages: list[dict[str, Any]]) -> None:
    """Flight windows, alone or attached to an event (they belong to the rank)."""
    if messages:
        rows = [build.flight_row(m, batch.run_ids) for m in messages]
        batch.conn.execute(insert(Flight), rows)


def byes(batch: Batch, messages: list[dict[str, Any]]) -> None:
    """A rank's exit: when, why, and its last step."""
    conn, run_ids, rank_ids, now = batch.conn, batch.run_ids, batch.rank_ids, batch.now
    for message in messages:
        body = message["body"]
        step = max(0, body["step"])
        conn.execute(
            sql_update(Rank)
            .where(Rank.id == bindparam("rid"))
            .values(
                finished_at=bindparam("now"),
                bye_reason=clean_str(body.get("reason"), 500),
                step=_greatest(Rank.step, "bye_step"),
            ),
            {"rid": rank_ids[_rank_key(message, run_ids)], "now": now, "bye_step": step},
        )


def touch_runs(
    conn: Connection, fresh: Iterable[dict[str, Any]], run_ids: RunIds, now: float
) -> None:
    stats: dict[int, dict[str, Any]] = {}
    for message in fresh:
        run_id = run_ids.of(message)
        entry = stats.get(run_id)
        if entry is None:
            entry = stats[run_id] = {"rid": run_id, "now": now, "step": 0, "n": 0, "ws": 0}
        kind, body = message["kind"], message["body"]
        world = message["rank"] + 1
        if kind == "heartbeat" or kind == "bye":
            if body["step"] > entry["step"]:
                entry["step"] = body["step"]
        elif kind == "event":
            entry["n"] += 1
            world = max(world, build.int_or_zero(body["event"].get("world_size")))
        elif kind == "hello":
            world = max(world, body["world_size"])
        if world > entry["ws"]:
            entry["ws"] = world
    # In run id order, the order runlock and every other server lock runs in: two
    # servers' batches of the same runs then wait for each other, never deadlock.
    conn.execute(_RUN_TOUCH, sorted(stats.values(), key=lambda entry: entry["rid"]))


_RUN_TOUCH = (
    sql_update(Run)
    .where(Run.id == bindparam("rid"))
    .values(
        last_seen=_greatest(Run.last_seen, "now"),
        updated_at=bindparam("now"),
        latest_step=_greatest(Run.latest_step, "step"),
        event_count=Run.event_count + bindparam("n"),
        world_size=_greatest(Run.world_size, "ws"),
    )
)


def drop_counts(batch: Batch, beats: list[dict[str, Any]]) -> None:
    """The agents' loss counts a heartbeat carries (``losses.store``)."""
    batch.written = losses.store(batch.conn, beats, batch.run_ids, batch.rank_ids, batch.drops)


def warnings(batch: Batch, messages: list[dict[str, Any]]) -> None:
    """Early warnings from the agents (``alerts.store``)."""
    alerts.store(batch.conn, messages, batch.run_ids)


def fingerprints(batch: Batch, messages: list[dict[str, Any]]) -> None:
    """The replicas' fingerprints, compared across ranks (``replicas.store``)."""
    replicas.store(batch.conn, messages, batch.run_ids)


def grad_outliers(batch: Batch, beats: list[dict[str, Any]]) -> None:
    """A rank whose own gradients stand out from the others' (``outliers.store``)."""
    outliers.store(batch.conn, beats, batch.run_ids, batch.grad_outlier_factor)


#: Before the run lock, in this order: a hello makes the rank's identity
#: before its reports, a bye comes after a rank's events.
UNLOCKED: tuple[tuple[str, Store], ...] = (
    ("hello", hellos),
    ("heartbeat", heartbeats),
    ("heartbeat", drop_counts),
    ("event", events),
    ("flight", flights),
    ("warning", warnings),
    ("bye", byes),
)
#: Under the run lock (one server per run): they compare a step's ranks.
LOCKED: tuple[tuple[str, Store], ...] = (
    ("fingerprint", fingerprints),
    ("heartbeat", grad_outliers),
)
