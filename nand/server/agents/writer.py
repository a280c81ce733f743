"""Write one batch of validated agent messages in one transaction.

:func:`write_batch` is the whole store-side of ingest: it drops duplicates by
``(agent, seq)`` (a primary key, so two servers cannot both store a message),
creates runs (one row per attempt: :mod:`nand.server.agents.attempts`) and ranks on
first sight, stores events, heartbeats and flight windows, keeps each
rank's cached first event with a conditional update and its agents' loss
counts (:mod:`nand.server.analysis.losses`).
It returns the ``(agent, seq)`` pairs that are now committed, duplicates
included, which is exactly what the ingest loop may acknowledge.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, case, insert, select, tuple_
from sqlalchemy import update as sql_update
from sqlalchemy.exc import IntegrityError

from nand.server.agents import attempts, bulk
from nand.server.agents import rows as build
from nand.server.agents.attempts import RunIds
from nand.server.agents.sanitize import clean_str
from nand.server.agents.seqs import highest_seqs
from nand.server.analysis import alerts, losses, outliers, replicas
from nand.server.analysis import firsts as firsts_mod
from nand.server.settings import Settings
from nand.server.storage import runlock
from nand.server.storage.db import chunks, insert_ignoring_conflicts
from nand.server.storage.models import Agent, EventRow, Flight, Heartbeat, Message, Rank, Run

Key = tuple[str, int]


@dataclass
class BatchResult:
    """What a committed batch did: pairs to acknowledge and what was new."""

    acked: list[Key] = field(default_factory=list)
    stored: int = 0
    duplicates: int = 0
    events: int = 0
    runs: set[str] = field(default_factory=set)
    #: Stored messages by kind.
    kinds: Counter[str] = field(default_factory=Counter)


def write_batch(
    engine: Engine,
    messages: list[dict[str, Any]],
    now: float,
    lost_after_s: float = Settings.lost_after_s,
    grad_outlier_factor: float = Settings.grad_outlier_factor,
    drops: losses.Committed | None = None,
) -> BatchResult:
    """Store ``messages`` (decoded and validated) and commit; see the module doc.

    ``lost_after_s``: how long a silent rank counts as alive, which decides
    whether a rerun without a launch identity is a new attempt.
    ``grad_outlier_factor``: see ``outliers.standing_out``.
    ``drops``: the loss counts committed before (the ingest loop's), so that
    heartbeats repeating them write nothing; told the new ones after the commit.
    """
    try:
        return _write_batch(engine, messages, now, lost_after_s, grad_outlier_factor, drops)
    except IntegrityError:
        # Another server committed one of these messages between our lookup and
        # our insert: a second pass sees it and skips it.
        return _write_batch(engine, messages, now, lost_after_s, grad_outlier_factor, drops)


def _write_batch(
    engine: Engine,
    messages: list[dict[str, Any]],
    now: float,
    lost_after_s: float,
    grad_outlier_factor: float,
    drops: losses.Committed | None,
) -> BatchResult:
    unique: dict[Key, dict[str, Any]] = {}
    for message in messages:
        unique.setdefault((message["agent"], message["seq"]), message)
    result = BatchResult(acked=list(unique))
    with engine.begin() as conn:
        started = _first_sent(unique.values(), now)
        run_ids = attempts.resolve(conn, unique.values(), started, now, lost_after_s)
        fresh = _claim(conn, unique, run_ids)
        result.duplicates = len(messages) - len(fresh)
        result.stored = len(fresh)
        written: list[dict[str, Any]] = []
        if fresh:
            by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for message in fresh:
                by_kind[message["kind"]].append(message)
            written = _store(conn, fresh, by_kind, run_ids, now, grad_outlier_factor, drops)
            result.events = len(by_kind["event"])
            result.runs = {m["run"] for m in fresh}
            result.kinds = Counter({kind: len(some) for kind, some in by_kind.items() if some})
    if drops is not None:
        drops.add(written)  # committed now
    return result


def _first_sent(messages: Iterable[dict[str, Any]], now: float) -> dict[str, float]:
    """Per run, when its earliest message in the batch was sent (the agent's clock),
    at most now: a new run started then, not when a spool replay or a slow link
    brought its first message (the dashboard's strip and charts start there)."""
    first: dict[str, float] = {}
    for message in messages:
        run, sent = message["run"], message["time"]
        if sent < first.get(run, now):
            first[run] = sent
        elif run not in first:
            first[run] = now
    return first


def _claim(
    conn: Connection, unique: dict[Key, dict[str, Any]], run_ids: RunIds
) -> list[dict[str, Any]]:
    """Insert the dedup keys of the messages not stored before; return those messages.

    An agent numbers its messages upwards, so a key above the agent's highest
    stored ``seq`` is new without a lookup (one index probe per agent); only
    resends at or below it are looked up. The insert then fails on the primary
    key only if another server stored the same message in the meantime, and
    :func:`write_batch` retries.
    """
    by_agent: dict[str, list[int]] = defaultdict(list)
    for agent, seq in unique:
        by_agent[agent].append(seq)
    seen: set[Key] = set()
    for agent, highest in highest_seqs(conn, list(by_agent)).items():
        old = [seq for seq in by_agent[agent] if seq <= highest]
        for chunk in chunks(old):
            found = conn.execute(
                select(Message.seq).where(Message.agent == agent, Message.seq.in_(chunk))
            )
            seen.update((agent, seq) for (seq,) in found)
    fresh = [m for key, m in unique.items() if key not in seen] if seen else list(unique.values())
    if fresh:
        of = run_ids.of
        rows = [(m["agent"], m["seq"], of(m)) for m in fresh]
        insert_rows(conn, Message, ("agent", "seq", "run_id"), rows)
    return fresh


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


def _store(
    conn: Connection,
    fresh: list[dict[str, Any]],
    by_kind: dict[str, list[dict[str, Any]]],
    run_ids: RunIds,
    now: float,
    grad_outlier_factor: float,
    drops: losses.Committed | None,
) -> list[dict[str, Any]]:
    """Everything but the dedup keys (``by_kind``: ``fresh`` by kind, a defaultdict);
    the drop rows written (``losses.store``)."""
    rank_ids = _ensure_ranks(conn, fresh, run_ids, now)
    _store_hellos(conn, by_kind["hello"], run_ids, rank_ids)
    _store_heartbeats(conn, by_kind["heartbeat"], run_ids, rank_ids, now)
    written = losses.store(conn, by_kind["heartbeat"], run_ids, rank_ids, drops)
    _store_events(conn, by_kind["event"], run_ids, rank_ids)
    _store_flights(conn, by_kind["flight"], run_ids)
    alerts.store(conn, by_kind["warning"], run_ids)
    _store_byes(conn, by_kind["bye"], run_ids, rank_ids, now)
    _touch_runs(conn, fresh, run_ids, now)
    # Both compare a step's ranks (world size: set above by a hello), one server per run:
    runlock.hold(conn, fresh, run_ids)
    replicas.store(conn, by_kind["fingerprint"], run_ids)
    outliers.store(conn, by_kind["heartbeat"], run_ids, grad_outlier_factor)
    return written


def _rank_key(message: dict[str, Any], run_ids: RunIds) -> tuple[int, int]:
    return run_ids.of(message), message["rank"]


def _ensure_ranks(
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


def _store_hellos(
    conn: Connection,
    hellos: list[dict[str, Any]],
    run_ids: RunIds,
    rank_ids: dict[tuple[int, int], int],
) -> None:
    for message in hellos:
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


def _store_heartbeats(
    conn: Connection,
    beats: list[dict[str, Any]],
    run_ids: RunIds,
    rank_ids: dict[tuple[int, int], int],
    now: float,
) -> None:
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


def _store_events(
    conn: Connection,
    messages: list[dict[str, Any]],
    run_ids: RunIds,
    rank_ids: dict[tuple[int, int], int],
) -> None:
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
    _store_flights(conn, [m for m in messages if m["body"].get("flight")], run_ids)


def _store_flights(conn: Connection, messages: list[dict[str, Any]], run_ids: RunIds) -> None:
    """Flight windows, alone or attached to an event (they belong to the rank)."""
    if messages:
        conn.execute(insert(Flight), [build.flight_row(m, run_ids) for m in messages])


def _store_byes(
    conn: Connection,
    byes: list[dict[str, Any]],
    run_ids: RunIds,
    rank_ids: dict[tuple[int, int], int],
    now: float,
) -> None:
    for message in byes:
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


def _touch_runs(
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
