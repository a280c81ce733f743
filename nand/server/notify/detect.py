"""Which runs changed state since the last look, and their notifications (the outbox rows).

A sweep reads the runs that may have changed (updated, seen lately, or
superseded since the last sweep), works out each attempt's state with the same
functions the verdict uses, and inserts one ``notifications`` row per new
(attempt, state key, URL). The unique constraint on those three makes the
insert idempotent, so servers sharing a database may sweep at the same time.

State keys (:data:`NOTIFY_STATES`): the run states ``diverged``,
``replica_mismatch``, ``lost``, ``crashed`` and ``stalled`` (a run is ``lost``
when a rank went silent, and so on: see ``nand.server.analysis.correlate.run_state``),
``warning:<kind>`` for the first warning of each kind, and ``stopped`` once a
stop was requested.
"""

from __future__ import annotations

import hashlib
import socket
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

from sqlalchemy import Engine, or_, select
from sqlalchemy.orm import Session

from nand.server.analysis import reads
from nand.server.schemas.verdict import Verdict
from nand.server.settings import WILDCARD_HOSTS, Settings
from nand.server.storage.db import insert_ignoring_conflicts
from nand.server.storage.models import Notification, Run, WarningRow

#: What a notification's ``state`` may be; a warning's key adds its kind.
NOTIFY_STATES = ("diverged", "replica_mismatch", "lost", "crashed", "stalled", "warning", "stopped")
#: The run states worth waking someone for (``healthy`` and ``finished`` are not).
RUN_STATES_NOTIFIED = frozenset(NOTIFY_STATES) - {"warning", "stopped"}
#: How far back the first sweep after a start looks (a server down for a while).
LOOKBACK_S = 24 * 3600.0

PHRASES = {
    "diverged": "diverged",
    "replica_mismatch": "has ranks whose replicas differ",
    "lost": "lost a rank",
    "crashed": "has a crashed rank",
    "stalled": "stalled",
    "stopped": "was stopped",
}


def target_key(url: str) -> str:
    """What the outbox stores for a URL: its digest (a webhook's path is a secret)."""
    return hashlib.sha256(url.encode()).hexdigest()


def sweep(engine: Engine, settings: Settings, since: float, now: float) -> int:
    """Insert the notifications of state changes in runs touched since ``since``; how many."""
    with Session(engine) as session:
        runs = _candidates(session, settings, since, now)
        if not runs:
            return 0
        ids = [run.id for run in runs]
        found = reads.Reads(session, settings, runs)
        kinds = _warning_kinds(session, [run.id for run in runs if run.warning_count])
        known = _known(session, ids)
        rows: list[dict[str, Any]] = []
        for run in runs:
            facts = (found, kinds[run.id], known[run.id])
            rows += _new_rows(session, run, *facts, settings, now)
        if rows:
            session.execute(insert_ignoring_conflicts(session.connection(), Notification), rows)
            session.commit()
        return len(rows)


def _new_rows(
    session: Session,
    run: Run,
    found: reads.Reads,
    warning_kinds: list[str],
    known: set[tuple[str, str]],
    settings: Settings,
    now: float,
) -> list[dict[str, Any]]:
    """The outbox rows of ``run``'s states not notified yet to each URL."""
    at = min(now, run.superseded_at or now)  # an old attempt's clock stopped then
    state = found.summary(run, at).state
    missing = [
        (key, url)
        for key in _keys(state, run.stop_step is not None, warning_kinds)
        for url in settings.notify_urls
        if (key, target_key(url)) not in known
    ]
    if not missing:
        return []
    verdict = found.verdict(run, at)
    return [_row(session, run, verdict, key, url, settings, now) for key, url in missing]


def _candidates(session: Session, settings: Settings, since: float, now: float) -> Sequence[Run]:
    """Runs whose state may have changed: touched since ``since``, or recently enough
    seen that a rank may turn lost or stalled with the clock."""
    active_since = min(since, now - settings.lost_after_s - 60.0)
    changed = or_(
        Run.updated_at >= since, Run.last_seen >= active_since, Run.superseded_at >= since
    )
    return session.scalars(select(Run).where(changed).order_by(Run.id)).all()


def _warning_kinds(session: Session, run_ids: list[int]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = defaultdict(list)
    if run_ids:
        statement = select(WarningRow.run_id, WarningRow.kind).where(WarningRow.run_id.in_(run_ids))
        for run_id, kind in session.execute(statement.distinct()).all():
            found[run_id].append(kind)
    return found


def _known(session: Session, run_ids: list[int]) -> dict[int, set[tuple[str, str]]]:
    """The (state key, target) pairs already in the outbox, per run."""
    found: dict[int, set[tuple[str, str]]] = defaultdict(set)
    statement = select(Notification.run_id, Notification.state, Notification.target).where(
        Notification.run_id.in_(run_ids)
    )
    for run_id, state, target in session.execute(statement).all():
        found[run_id].add((state, target))
    return found


def _keys(state: str, stopped: bool, warning_kinds: Iterable[str]) -> list[str]:
    keys = [state] if state in RUN_STATES_NOTIFIED else []
    keys += [f"warning:{kind}" for kind in sorted(warning_kinds)]
    return keys + (["stopped"] if stopped else [])


def _row(
    session: Session, run: Run, verdict: Verdict, key: str, url: str, settings: Settings, now: float
) -> dict[str, Any]:
    return {
        "run_id": run.id,
        "state": key,
        "target": target_key(url),
        "payload": payload(session, run, verdict, key, settings, now),
        "created": now,
        "attempts": 0,
        "next_try": now,
        "delivered_at": None,
        "last_error": "",
    }


def payload(
    session: Session, run: Run, verdict: Verdict, key: str, settings: Settings, now: float
) -> dict[str, Any]:
    """The JSON body of one notification (documented in the README)."""
    state, _, kind = key.partition(":")
    link = f"{dashboard_base(settings)}/#/runs/{quote(run.name, safe='')}"
    body: dict[str, Any] = {
        "id": f"{run.name}/{run.attempt}/{key}",
        "run": run.name,
        "attempt": run.attempt,
        "launch": run.launch,
        "state": state,
        "run_state": verdict.state,
        "summary": verdict.summary,
        "hint": verdict.hint,
        "origin": verdict.origin.model_dump(mode="json") if verdict.origin else None,
        "url": link,
        "time": now,
    }
    if kind:
        first = _first_warning(session, run.id, kind)
        body["warning"] = first
        sentence = str((first or {}).get("message") or f"A {kind} warning.")
    elif state == "stopped":
        body["stop"] = verdict.stop.model_dump(mode="json") if verdict.stop else None
        sentence = _stop_sentence(verdict)
    else:
        sentence = verdict.summary
    phrase = f"warned: {kind}" if kind else PHRASES[state]
    body["text"] = f"nand: run {run.name} (attempt {run.attempt}) {phrase}. {sentence} {link}"
    return body


def _first_warning(session: Session, run_id: int, kind: str) -> dict[str, Any] | None:
    statement = (
        select(WarningRow)
        .where(WarningRow.run_id == run_id, WarningRow.kind == kind)
        .order_by(WarningRow.step, WarningRow.rank, WarningRow.id)
        .limit(1)
    )
    row = session.scalars(statement).first()
    if row is None:
        return None
    fields = ("rank", "step", "kind", "module", "value", "reference", "message", "time")
    return {name: getattr(row, name) for name in fields}


def _stop_sentence(verdict: Verdict) -> str:
    if verdict.stop is None:
        return "A stop was requested."
    reason = f": {verdict.stop.reason}" if verdict.stop.reason else ""
    return f"A stop was requested at step {verdict.stop.step}{reason}."


def dashboard_base(settings: Settings) -> str:
    """``NAND_URL``, else the address the server serves on (bound to all
    interfaces: this machine's name).

    >>> dashboard_base(Settings(http_host="127.0.0.1", http_port=8080))
    'http://127.0.0.1:8080'
    >>> dashboard_base(Settings(public_url="https://nand.example.org/"))
    'https://nand.example.org'
    """
    if settings.public_url:
        return settings.public_url.rstrip("/")
    host = socket.gethostname() if settings.http_host in WILDCARD_HOSTS else settings.http_host
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{settings.http_port}"
