"""Messages the agents dropped before the server had them: stored, summed, shown.

An agent counts what it loses by reason (:data:`nand.events.DROP_REASONS`:
its memory queue or disk spool full during a long outage, a frame too large…)
and sends the cumulative counts as ``dropped`` in the next heartbeat after
they change, and again every minute. Heartbeats repeat those counts, arrive
late (a spool replayed after the outage) and out of order, so they are never
added up: ``drops`` keeps, per agent and reason, the largest count seen
(:func:`store`). A rank may have had several agents (a forked worker, a
restarted process), each counting from 0, so the rank's
losses (``ranks.dropped``, what the REST API and the dashboard show) are the
sum over its agents, recomputed for the ranks a batch touched.

A heartbeat mostly repeats the counts its agent sent before. The ingest
loop remembers the counts it committed (:class:`Committed`) and writes
nothing for a count it already has: a batch of such heartbeats costs no
statement. The memory is forgotten every :data:`REFRESH_S` seconds, so each
count is written again at least that often.

With several servers on one database, two batches for agents of the same rank
may each recompute the sum without the other's rows; the next heartbeat of
either agent that carries its counts (within a minute) written after the
refresh puts it right.

>>> total({"spool_full": 1000, "rejected": 204})
1204
>>> in_words({"spool_full": 1000, "rejected": 204})
'spool_full 1,000, rejected 204'
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, tuple_
from sqlalchemy import update as sql_update

from nand.events import DROP_REASONS
from nand.server.storage.db import dialect_insert
from nand.server.storage.models import Drop, Rank
from nand.server.storage.runids import RunIds

#: The ``/metrics`` label of a reason the vocabulary does not have (a newer agent's).
OTHER = "other"


#: Seconds after which the committed counts are forgotten (and written again).
REFRESH_S = 5.0
#: Most (agent, reason) counts remembered between refreshes.
MAX_REMEMBERED = 100_000

Key = tuple[str, str, int]  # agent, reason, run id


class Committed:
    """The largest count per (agent, reason, run) that this server has committed.

    Only a shortcut: the database has each of these counts (or a larger one,
    from another server), so a heartbeat repeating one changes nothing there.
    """

    def __init__(self) -> None:
        self.counts: dict[Key, int] = {}
        self._since = time.monotonic()

    def has(self, key: Key, count: int) -> bool:
        return self.counts.get(key, -1) >= count

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Remember ``rows`` (drop rows :func:`store` wrote) once they are committed."""
        now = time.monotonic()
        if now - self._since > REFRESH_S or len(self.counts) > MAX_REMEMBERED:
            self.counts.clear()
            self._since = now
        for row in rows:
            key = (row["agent"], row["reason"], row["run_id"])
            self.counts[key] = max(self.counts.get(key, 0), row["count"])


def store(
    conn: Connection,
    beats: Iterable[dict[str, Any]],
    run_ids: RunIds,
    rank_ids: Mapping[tuple[int, int], int],
    committed: Committed | None = None,
) -> list[dict[str, Any]]:
    """Keep the largest count per (agent, reason) of ``beats`` (validated
    heartbeats), then recompute ``ranks.dropped`` of the ranks they came from;
    counts ``committed`` already has are left out. The rows written."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    # An agent's heartbeats repeat its counts until it loses another message:
    # counts equal to its previous heartbeat's in this batch change nothing.
    previous: dict[str, dict[str, Any]] = {}
    for beat in beats:
        dropped = beat["body"].get("dropped")
        if not dropped or previous.get(beat["agent"]) == dropped:
            continue
        previous[beat["agent"]] = dropped
        run_id = run_ids.of(beat)
        for reason, count in dropped.items():
            if committed is not None and committed.has((beat["agent"], reason, run_id), count):
                continue
            row = latest.setdefault(
                (beat["agent"], reason),
                {"agent": beat["agent"], "reason": reason, "run_id": run_id, "count": 0},
            )
            row["rank"] = beat["rank"]
            row["count"] = max(row["count"], count)
    if not latest:
        return []
    rows = list(latest.values())
    conn.execute(_upsert(conn), rows)
    keys = {(row["run_id"], row["rank"]) for row in rows}
    sums = _sums(conn, keys)
    conn.execute(
        _RANK_DROPPED,
        [{"rid": rank_ids[key], "d": sums.get(key) or None} for key in sorted(keys)],
    )
    return rows


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
    if not isinstance(raw, dict) or not raw:
        return {}  # (most ranks: a page of 500 asks twice a rank)
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
