"""Delivery of the outbox: claim due rows, POST them, record the outcome.

A claim moves a row's ``next_try`` past the POST's timeout (a lease) in a
short transaction, with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so two
servers on one database never POST one row at the same time, and nothing is
held locked while the receiver answers. A server killed during a POST leaves
the row due again once the lease ends: delivery is at least once, and the
body's ``id`` lets a receiver drop a repeat.

A failure is retried after 1 s, 2 s, 4 s... up to :data:`MAX_BACKOFF_S`, each
delay with jitter (half to all of it), until the receiver takes it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from nand import __version__
from nand.server.notify.detect import target_key
from nand.server.storage.models import Notification

#: The signature header: ``sha256=`` and the hex HMAC-SHA256 of the body.
SIGNATURE_HEADER = "X-Nand-Signature-256"
#: The body's ``id`` again, for receivers that deduplicate on a header.
DELIVERY_HEADER = "X-Nand-Delivery"
MAX_BACKOFF_S = 300.0
#: Rows claimed per turn.
CLAIM_BATCH = 32


@dataclass(frozen=True)
class Delivery:
    id: int
    url: str
    body: bytes
    key: str
    attempts: int


@dataclass(frozen=True)
class Outcome:
    delivery: Delivery
    #: None when delivered, else one of :data:`nand.server.metrics.NOTIFY_FAILURES`.
    reason: str | None = None
    detail: str = ""


def sign(secret: str, body: bytes) -> str:
    """The signature header's value.

    >>> sign("s3cret", b'{"run": "r"}')[:15]
    'sha256=39fa33c1'
    """
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def claim(engine: Engine, urls: tuple[str, ...], lease_s: float, now: float) -> list[Delivery]:
    """Due rows for the configured URLs, leased to this server for ``lease_s``."""
    targets = {target_key(url): url for url in urls}
    statement = (
        select(Notification)
        .where(
            Notification.delivered_at.is_(None),
            Notification.next_try <= now,
            Notification.target.in_(sorted(targets)),
        )
        .order_by(Notification.id)
        .limit(CLAIM_BATCH)
        .with_for_update(skip_locked=True)
    )
    with Session(engine) as session, session.begin():
        rows = session.scalars(statement).all()
        for row in rows:
            row.next_try = now + lease_s
        return [
            Delivery(row.id, targets[row.target], encode(row.payload), _key(row), row.attempts)
            for row in rows
        ]


def _key(row: Notification) -> str:
    return str(row.payload.get("id", row.id))


def post(delivery: Delivery, secret: str | None, timeout_s: float) -> Outcome:
    """POST one notification; any 2xx answer delivers it."""
    headers = {
        "Content-Type": "application/json",
        "User-Agent": f"nand/{__version__}",
        DELIVERY_HEADER: delivery.key.encode("ascii", "backslashreplace").decode(),
    }
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, delivery.body)
    request = urllib.request.Request(delivery.url, data=delivery.body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read(64 * 1024)
    except urllib.error.HTTPError as exc:
        return Outcome(delivery, "http_status", f"HTTP {exc.code}")
    except urllib.error.URLError as exc:
        timed_out = isinstance(exc.reason, TimeoutError)
        return Outcome(delivery, "timeout" if timed_out else "unreachable", str(exc.reason))
    except TimeoutError as exc:
        return Outcome(delivery, "timeout", str(exc) or "timed out")
    except OSError as exc:
        return Outcome(delivery, "unreachable", str(exc))
    return Outcome(delivery)


def backoff_s(attempts: int) -> float:
    """Seconds before try ``attempts + 1``, with jitter.

    >>> 0.5 <= backoff_s(1) <= 1.0, backoff_s(40) <= MAX_BACKOFF_S
    (True, True)
    """
    base = min(MAX_BACKOFF_S, 2.0 ** max(attempts - 1, 0))
    return base * (0.5 + random.random() / 2)


def record(engine: Engine, outcomes: list[Outcome], now: float) -> None:
    """Mark what was delivered; schedule the rest again."""
    with Session(engine) as session, session.begin():
        for outcome in outcomes:
            tries = outcome.delivery.attempts + 1
            values: dict[str, Any] = {"attempts": tries}
            if outcome.reason is None:
                values["delivered_at"] = now
            else:
                values["next_try"] = now + backoff_s(tries)
                values["last_error"] = f"{outcome.reason}: {outcome.detail}"[:500]
            where = Notification.id == outcome.delivery.id
            session.execute(update(Notification).where(where).values(**values))


def pending(engine: Engine) -> int:
    """Notifications not delivered yet, for ``/metrics``."""
    with Session(engine) as session:
        count = select(func.count()).where(Notification.delivered_at.is_(None))
        return int(session.scalar(count.select_from(Notification)) or 0)
