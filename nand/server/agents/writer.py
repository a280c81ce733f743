"""Write one batch of validated agent messages in one transaction.

:func:`write_batch` is the whole store-side of ingest: it drops duplicates by
``(agent, seq)`` (a primary key, so two servers cannot both store a message),
creates runs (one row per attempt: :mod:`nand.server.agents.attempts`) and ranks on
first sight, and stores each kind of message by its handlers
(:mod:`nand.server.agents.stores`: events, heartbeats, flight windows, each
rank's cached first event, its agents' loss counts...).
It returns the ``(agent, seq)`` pairs that are now committed, duplicates
included, which is exactly what the ingest loop may acknowledge.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, select
from sqlalchemy.exc import IntegrityError

from nand.server.agents import attempts, stores
from nand.server.agents.seqs import highest_seqs
from nand.server.analysis import losses
from nand.server.settings import Settings
from nand.server.storage import runlock
from nand.server.storage.db import chunks
from nand.server.storage.models import Message
from nand.server.storage.runids import RunIds

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
        stores.insert_rows(conn, Message, ("agent", "seq", "run_id"), rows)
    return fresh


def _store(
    conn: Connection,
    fresh: list[dict[str, Any]],
    by_kind: dict[str, list[dict[str, Any]]],
    run_ids: RunIds,
    now: float,
    grad_outlier_factor: float,
    drops: losses.Committed | None,
) -> list[dict[str, Any]]:
    """Everything but the dedup keys (``by_kind``: ``fresh`` by kind, a defaultdict),
    each kind by its handlers (:data:`stores.UNLOCKED`, :data:`stores.LOCKED`);
    the drop rows written (``losses.store``)."""
    rank_ids = stores.ensure_ranks(conn, fresh, run_ids, now)
    batch = stores.Batch(conn, run_ids, rank_ids, now, grad_outlier_factor, drops)
    for kind, store in stores.UNLOCKED:
        store(batch, by_kind[kind])
    stores.touch_runs(conn, fresh, run_ids, now)
    # Both compare a step's ranks (world size: set above by a hello), one server per run:
    runlock.hold(conn, fresh, run_ids)
    for kind, store in stores.LOCKED:
        store(batch, by_kind[kind])
    return batch.written
