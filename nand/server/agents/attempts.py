"""Attempts: a run id used again is a new attempt, not more of the old run.

A Kubernetes Job re-applied under the same name (its pods take ``NAND_RUN``
from the Job's name), a requeued Slurm job or a script started again by hand
sends hellos under a run id the server already has, from new processes. Were
they the same run, the new ranks would inherit the old attempt's "diverged"
and a watchdog would kill the healthy rerun. So the writer keeps one ``runs``
row per attempt (``attempt`` 1, 2, ...; the newest is the *live* one, the
others have ``superseded_at``) and decides, per batch, where each message
goes (:func:`resolve`). Only a hello from an agent the server has not seen
can start an attempt:

- an agent seen before stays in its attempt, whatever it sends: a reconnect,
  a resend or a spool replayed after a crash lands where it was first stored;
- with a launch identity (the agents' ``NAND_LAUNCH``, the same on every rank
  of one launch): a launch already seen goes to its attempt (a late rank, even
  of an older attempt); a new launch starts a new attempt at once, unless the
  live attempt has no launch and no rank yet (then it is this launch's);
- without one: a hello starts a new attempt when its rank is already held by
  another process (host, pid) *and* every rank of the live attempt has ended
  (said bye, crashed) or gone silent for ``lost_after_s``. A late rank joins
  (its rank is free), a second ``nand.watch`` in the same process joins (same
  process), and a forked DataLoader worker joins (its rank is still alive).

The REST API, ``nand verdict``, ``nand stop``, ``nand wait`` and the dashboard
act on the live attempt; ``?attempt=N`` reads an earlier one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy import update as sql_update

from nand.server.storage.db import insert_ignoring_conflicts
from nand.server.storage.models import Agent, Rank, Run
from nand.server.storage.runids import RunIds
from nand.server.storage.sanitize import clean_str


def resolve(
    conn: Connection,
    messages: Iterable[dict[str, Any]],
    started: dict[str, float],
    now: float,
    lost_after_s: float,
) -> RunIds:
    """The attempt of every message, starting attempts as the module doc says.

    ``started`` maps each run name in the batch to its earliest message time.
    """
    agents: set[str] = set()
    hellos = []
    for message in messages:  # (one pass: a batch holds thousands)
        agents.add(message["agent"])
        if message["kind"] == "hello":
            hellos.append(message)
    _create_first_attempts(conn, started, now)
    ids = RunIds(live=_live_attempts(conn, set(started)))
    ids.by_agent = _known_agents(conn, agents)
    for hello in hellos:
        if hello["agent"] not in ids.by_agent:
            ids.by_agent[hello["agent"]] = _attempt_for(conn, ids, hello, now, lost_after_s)
    return ids


def launch_of(hello: dict[str, Any]) -> str | None:
    return clean_str(hello["body"].get("launch"), 256) or None


def _attempt_for(
    conn: Connection, ids: RunIds, hello: dict[str, Any], now: float, lost_after_s: float
) -> int:
    """The attempt a new agent's hello belongs to (a new one if it starts one)."""
    name, live_id = hello["run"], ids.live[hello["run"]]
    launch = launch_of(hello)
    if launch is not None:
        seen = _attempt_of_launch(conn, name, launch)
        if seen is not None:
            return seen
        if _unclaimed(conn, live_id):
            conn.execute(sql_update(Run).where(Run.id == live_id).values(launch=launch))
            return live_id
    elif not _is_rerun(conn, live_id, hello, now - lost_after_s):
        return live_id
    ids.live[name] = _new_attempt(conn, live_id, hello, launch, now)
    return ids.live[name]


def _create_first_attempts(conn: Connection, started: dict[str, float], now: float) -> None:
    """Attempt 1 of each name never seen before."""
    known = set(conn.scalars(select(Run.name).where(Run.name.in_(set(started)))))
    rows = [
        {"name": n, "attempt": 1, "started_at": t, "last_seen": now, "updated_at": now}
        for n, t in started.items()
        if n not in known
    ]
    if rows:  # on conflict: another server sharing the database made it first
        conn.execute(insert_ignoring_conflicts(conn, Run), rows)


def _live_attempts(conn: Connection, names: set[str]) -> dict[str, int]:
    statement = select(Run.name, Run.id).where(Run.name.in_(names), Run.superseded_at.is_(None))
    return {name: run_id for name, run_id in conn.execute(statement)}


def _known_agents(conn: Connection, agents: set[str]) -> dict[str, int]:
    statement = select(Agent.agent, Agent.run_id).where(Agent.agent.in_(agents))
    return {agent: run_id for agent, run_id in conn.execute(statement)}


def _attempt_of_launch(conn: Connection, name: str, launch: str) -> int | None:
    statement = select(Run.id).where(Run.name == name, Run.launch == launch)
    return conn.scalars(statement.order_by(Run.attempt.desc()).limit(1)).first()


def _unclaimed(conn: Connection, run_id: int) -> bool:
    """No launch and no rank yet: the attempt the first hello of a launch takes."""
    launch = conn.scalar(select(Run.launch).where(Run.id == run_id))
    has_rank = conn.scalar(select(func.count()).where(Rank.run_id == run_id))
    return launch is None and not has_rank


def _is_rerun(conn: Connection, run_id: int, hello: dict[str, Any], silent_before: float) -> bool:
    """Another process holds this rank, and no rank of the attempt is alive.

    Two indexed lookups, not a read of every rank: a hello of each of a
    100,000-rank run's ranks read the ranks already there (quadratic).
    """
    holder = conn.execute(
        select(Rank.host, Rank.pid).where(Rank.run_id == run_id, Rank.rank == hello["rank"])
    ).first()
    body = hello["body"]
    if holder is None or not holder.pid:
        return False
    if (holder.host, holder.pid) == (body.get("host"), body.get("pid")):
        return False
    alive = select(Rank.id).where(
        Rank.run_id == run_id, Rank.finished_at.is_(None), Rank.last_seen >= silent_before
    )
    return conn.execute(alive.limit(1)).first() is None


def _new_attempt(
    conn: Connection, old_id: int, hello: dict[str, Any], launch: str | None, now: float
) -> int:
    """Supersede the live attempt with the next one; its id."""
    old = conn.execute(select(Run.name, Run.attempt).where(Run.id == old_id)).one()
    conn.execute(sql_update(Run).where(Run.id == old_id).values(superseded_at=now, updated_at=now))
    number = old.attempt + 1
    row = {
        "name": old.name,
        "attempt": number,
        "launch": launch,
        "started_at": min(now, hello["time"]),
        "last_seen": now,
        "updated_at": now,
    }
    # On conflict another server sharing the database started it first: join it.
    conn.execute(insert_ignoring_conflicts(conn, Run), [row])
    statement = select(Run.id).where(Run.name == old.name, Run.attempt == number)
    return int(conn.execute(statement).scalar_one())
