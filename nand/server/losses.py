"""Messages the agents dropped before the server had them: stored, summed, shown.

An agent counts what it loses by reason (:data:`nand.events.DROP_REASONS`:
its memory queue or disk spool full during a long outage, a frame too large…)
and sends the cumulative counts in every heartbeat as ``dropped``. Heartbeats
repeat those counts, arrive late (a spool replayed after the outage) and out
of order, so they are never added up: ``drops`` keeps, per agent and reason,
the largest count seen (:func:`store`). A rank may have had several agents (a
forked worker, a restarted process), each counting from 0, so the rank's
losses (``ranks.dropped``, what the REST API and the dashboard show) are the
sum over its agents, recomputed for the ranks a batch touched.

With several servers on one database, two batches for agents of the same rank
may each recompute the sum without the other's rows; the next heartbeat of
either agent puts it right (they come every ``NAND_HEARTBEAT_S``).

>>> total({"spool_full": 1000, "rejected": 204})
1204
>>> in_words({"spool_full": 1000, "rejected": 204})
'spool_full 1,000, rejected 204'
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, tuple_
from sqlalchemy import update as sql_update

from nand.events import DROP_REASONS
from nand.server.attempts import RunIds
from nand.server.db import dialect_insert
from nand.server.models import Drop, Rank

#: The ``/metrics`` label of a reason the vocabulary does not have (a newer agent's).
OTHER = "other"


def store(
    conn: Connection,
    beats: Iterable[dict[str, Any]],
    run_ids: RunIds,
    rank_ids: Mapping[tuple[int, int], int],
) -> None:
    """Keep the largest count per (agent, reason) of ``beats`` (validated
    heartbeats), then recompute ``ranks.dropped`` of the ranks they came from."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for beat in beats:
        run_id = run_ids.of(beat)
        for reason, count in (beat["body"].get("dropped") or {}).items():
            row = latest.setdefault(
                (beat["agent"], reason),
                {"agent": beat["agent"], "reason": reason, "run_id": run_id, "count": 0},
            )
            row["rank"] = beat["rank"]
            row["count"] = max(row["count"], count)
    if not latest:
        return
    conn.execute(_upsert(conn), list(latest.values()))
    keys = {(row["run_id"], row["rank"]) for row in latest.values()}
    sums = _sums(conn, keys)
    conn.execute(
        _RANK_DROPPED,
        [{"rid": rank_ids[key], "d": sums.get(key) or None} for key in sorted(keys)],
    )


def _upsert(conn: Connection) -> Any:
    """INSERT, or on a known (agent, reason) keep the larger count."""
    statement = dialect_insert(conn, Drop)
    return statement.on_conflict_do_update(
        index_elements=[Drop.agent, Drop.reason],
        set_={"count": statement.excluded.count},
        where=statement.excluded.count > Drop.count,
    )


def _sums(conn: Connection, keys: set[tuple[int, int]]) -> dict[tuple[int, int], dict[str, int]]:
    statement = (
        select(Drop.run_id, Drop.rank, Drop.reason, func.sum(Drop.count))
        .where(tuple_(Drop.run_id, Drop.rank).in_(sorted(keys)))
        .group_by(Drop.run_id, Drop.rank, Drop.reason)
        .order_by(Drop.reason)
    )
    sums: dict[tuple[int, int], dict[str, int]] = {}
    for run_id, rank, reason, count in conn.execute(statement):
        if count:
            sums.setdefault((run_id, rank), {})[reason] = int(count)
    return sums


_RANK_DROPPED = (
    sql_update(Rank)
    .where(Rank.id == bindparam("rid"))
    .values(dropped=bindparam("d", type_=Rank.dropped.type))
)


def of_rank(rank: Rank) -> dict[str, int]:
    """A rank's losses by reason, largest first (``{}``: none)."""
    return counts(rank.dropped)


def counts(raw: object) -> dict[str, int]:
    """A ``ranks.dropped`` value as losses by reason, largest first (``{}``: none)."""
    raw = raw if isinstance(raw, dict) else {}
    found = {str(k): v for k, v in raw.items() if isinstance(v, int) and v > 0}
    return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


def total(dropped: Mapping[str, int]) -> int:
    return sum(dropped.values())


def summed(per_rank: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Losses by reason over several ranks, largest first."""
    counts: Counter[str] = Counter()
    for dropped in per_rank:
        counts.update(dropped)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def metric_labels(dropped: Mapping[str, int]) -> dict[str, int]:
    """Counts by ``/metrics`` label: every known reason (0 if none), the rest
    as :data:`OTHER`, so a newer agent cannot add label values.

    >>> metric_labels({"spool_full": 3, "from_the_future": 2})["other"]
    2
    """
    labels = dict.fromkeys((*DROP_REASONS, OTHER), 0)
    for reason, count in dropped.items():
        labels[reason if reason in DROP_REASONS else OTHER] += count
    return labels


def in_words(dropped: Mapping[str, int]) -> str:
    """``spool_full 1,000, rejected 204`` (largest first, as given)."""
    return ", ".join(f"{reason} {count:,}" for reason, count in dropped.items())


def per_rank(ranks: Iterable[Rank]) -> dict[int, dict[str, int]]:
    """The ranks that dropped anything, with their losses by reason."""
    return {rank.rank: found for rank in ranks if (found := of_rank(rank))}


def sentence(by_rank: Mapping[int, Mapping[str, int]]) -> str:
    """What a person must know about a run with gaps, or ``""`` without any.

    >>> print(sentence({3: {"spool_full": 1000, "rejected": 204}}))
    Rank 3 dropped 1,204 messages before the server had them (spool_full 1,000,
    rejected 204): its record here has gaps.
    >>> print(sentence({0: {"queue_full": 1}, 1: {"queue_full": 1}, 2: {"spool_full": 5}}))
    Ranks 0-2 dropped 7 messages before the server had them (spool_full 5,
    queue_full 2): their records here have gaps.
    """
    if not by_rank:
        return ""
    dropped = summed(by_rank.values())
    n = total(dropped)
    messages = f"{n:,} message" + ("" if n == 1 else "s")
    ranks = sorted(by_rank)
    who, whose = (
        (f"Rank {ranks[0]}", "its record here has")
        if len(ranks) == 1
        else (f"Ranks {rank_ranges(ranks)}", "their records here have")
    )
    return (
        f"{who} dropped {messages} before the server had them ({in_words(dropped)}): {whose} gaps."
    )


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5`` (sorted input)."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
