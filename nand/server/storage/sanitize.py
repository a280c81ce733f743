"""Make validated wire values fit the database, so one odd message cannot
poison a batch: integers within the columns' range, strings without NUL
(PostgreSQL refuses it) and within the column length, floats finite or None.

>>> clean_str("a\\x00b", 10), finite(float("nan")), out_of_range({"seq": 2**70, "time": 1.0})
('ab', None, 'seq')
"""

from __future__ import annotations

import math
from typing import Any

from nand.server.storage.bounds import INT32, INT64

#: Integer fields (envelope, body or event) and the largest value stored.
_ENVELOPE_LIMITS = {"seq": INT64, "rank": INT32}
_BODY_LIMITS = {"step": INT32, "world_size": INT32, "pid": INT32, "amp_skipped": INT32}
_EVENT_LIMITS = {
    "step": INT32,
    "micro_step": INT32,
    "order": INT32,
    "world_size": INT32,
    "pid": INT32,
    "call": INT32,
    "seq": INT64,
    "nan": INT64,
    "posinf": INT64,
    "neginf": INT64,
}


def clean_str(value: Any, limit: int) -> str:
    if not isinstance(value, str):
        return ""
    return value.replace("\x00", "")[:limit]


def number(value: Any) -> float | None:
    """A float as sent, NaN and ±inf included (they say what the values were)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return float(value) if -(2**1023) < value < 2**1023 else None
    return float(value)


def finite(value: Any) -> float | None:
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is int:
        number = float(value) if -(2**1023) < value < 2**1023 else math.inf
        return number if math.isfinite(number) else None
    if isinstance(value, float):  # a float subclass
        return finite(float(value))
    return None


def jsonable(value: Any, depth: int = 0) -> Any:
    """A JSON-storable copy: finite floats, str keys, no bytes or NUL, bounded depth."""
    if depth > 32:
        return None
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value.replace("\x00", "")
    if isinstance(value, dict):
        return {clean_str(str(k), 256): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v, depth + 1) for v in value]
    return None


def out_of_range(message: dict[str, Any]) -> str | None:
    """The first field that cannot be stored as it is, or None: an integer
    beyond its column, an identity (agent, run) with NUL, a non-finite time."""
    for key in ("agent", "run"):
        if "\x00" in message.get(key, ""):
            return key
    if finite(message.get("time")) is None:
        return "time"
    bad = _check(message, _ENVELOPE_LIMITS)
    body = message.get("body")
    if bad or not isinstance(body, dict):
        return bad
    bad = _check(body, _BODY_LIMITS)
    event = body.get("event")
    if bad or not isinstance(event, dict):
        return bad
    if any(not -INT32 <= d <= INT32 for d in event.get("shape") or []):
        return "event.shape"
    bad = _check(event, _EVENT_LIMITS)
    return f"event.{bad}" if bad else None


def _check(obj: dict[str, Any], limits: dict[str, int]) -> str | None:
    for key, limit in limits.items():
        value = obj.get(key)
        if type(value) is int and not -limit <= value <= limit:  # (bool is no int here)
            return key
    return None
