"""Table rows from validated wire messages: pure functions, no database.

Values are made storable here (:mod:`nand.server.storage.sanitize`): strings cut to
their column and without NUL, non-finite floats as None (the counts say what
they were), odd types as defaults.
"""

from __future__ import annotations

import math
from typing import Any

from nand.events import PHASE_RANK, Event, value_kinds
from nand.server.analysis.evidence import flight_evidence
from nand.server.storage.runids import RunIds
from nand.server.storage.sanitize import clean_str, finite, jsonable, number


def logical_key(row: dict[str, Any]) -> tuple[int, int, int, int]:
    """(step, micro_step, phase, order) of an event row: the order of DESIGN.md."""
    return (row["step"], row["micro_step"], row["phase_rank"], row["ord"])


def agent_row(message: dict[str, Any], run_id: int) -> dict[str, Any]:
    return {
        "agent": message["agent"],
        "run_id": run_id,
        "rank": message["rank"],
        "hello_at": message["time"],
    }


def run_info(body: dict[str, Any]) -> dict[str, Any]:
    """Run-level facts a hello carries (the last hello wins; ranks agree on them)."""
    info: dict[str, Any] = {}
    modules = body.get("modules")
    if isinstance(modules, list) and modules:
        info["modules"] = jsonable(modules)
    optimizer = body.get("optimizer")
    if isinstance(optimizer, str):
        info["optimizer"] = clean_str(optimizer, 256)
    elif isinstance(optimizer, dict) and isinstance(optimizer.get("type"), str):
        info["optimizer"] = clean_str(optimizer["type"], 256)
    versions = body.get("versions")
    if isinstance(versions, dict):
        info["versions"] = {
            clean_str(str(k), 64): clean_str(str(v), 256) for k, v in versions.items()
        }
    return info


#: The ``heartbeats`` columns :func:`heartbeat_values` fills, in its order.
HEARTBEAT_COLUMNS = (
    "run_id",
    "rank",
    "time",
    "step",
    "loss",
    "grad_norm",
    "steps_per_s",
    "max_activation",
)


def heartbeat_values(message: dict[str, Any], run_id: int) -> tuple[Any, ...]:
    """A heartbeat's row as a tuple in :data:`HEARTBEAT_COLUMNS` order (one per
    heartbeat: no dict is built for it)."""
    body = message["body"]
    return (
        run_id,
        message["rank"],
        message["time"],
        body["step"],
        finite(body.get("loss")),
        finite(body.get("grad_norm")),
        finite(body.get("steps_per_s")),
        finite(body.get("max_activation")),
    )


def progress_params(
    rank_id: int, row: tuple[Any, ...], message: dict[str, Any], now: float
) -> dict[str, Any]:
    """The rank's progress from its latest heartbeat (``row``: its values)."""
    _, _, _, step, loss, grad_norm, steps_per_s, max_activation = row
    skipped = message["body"].get("amp_skipped")
    return {
        "rid": rank_id,
        "now": now,
        "hb_step": step,
        "hb_sps": steps_per_s,
        "hb_loss": loss,
        "hb_gn": grad_norm,
        "hb_act": max_activation,
        "hb_amp": skipped if isinstance(skipped, int) and not isinstance(skipped, bool) else 0,
    }


def event_row(message: dict[str, Any], run_ids: RunIds) -> dict[str, Any]:
    event = message["body"]["event"]
    return {
        "run_id": run_ids.of(message),
        "rank": message["rank"],
        "world_size": int_or_zero(event.get("world_size")),
        "host": clean_str(event.get("host"), 256),
        "pid": int_or_zero(event.get("pid")),
        "step": event["step"],
        "micro_step": event["micro_step"],
        "phase": event["phase"],
        "phase_rank": PHASE_RANK[event["phase"]],
        "module": clean_str(event["module"], 512),
        "module_type": clean_str(event.get("module_type"), 256),
        "ord": event["order"],
        "cause": clean_str(event["cause"], 32),
        "call": int_or_zero(event.get("call")),
        "nan": event.get("nan"),
        "posinf": event.get("posinf"),
        "neginf": event.get("neginf"),
        # Kept non-finite: an infinite max is how an activation event says +inf.
        "min": number(event.get("min")),
        "max": number(event.get("max")),
        "max_abs": finite(event.get("max_abs")),
        "shape": event.get("shape") or [],
        "dtype": clean_str(event.get("dtype"), 64),
        "time": _float(event.get("time"), message["time"]),
        "seq": int_or_zero(event.get("seq")),
        "message": clean_str(event.get("message"), 2000),
        "kinds": _kinds(event),
        "op": clean_str(event.get("op"), 128),
        "source": clean_str(event.get("source"), 1024),
        "reproduced": _bool_or_none(event.get("reproduced")),
        "replay": clean_str(event.get("replay"), 300),
        "via": clean_str(event.get("via"), 80),
    }


def _kinds(event: dict[str, Any]) -> str:
    """What the values were, in words, from the wire's figures (before SQLite
    turns a NaN min/max into NULL and the kind with it)."""

    def count(name: str) -> int | None:
        value = event.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    figures = Event(
        nan=count("nan"),
        posinf=count("posinf"),
        neginf=count("neginf"),
        min=number(event.get("min")),
        max=number(event.get("max")),
    )
    return value_kinds(figures)


def int_or_zero(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any, default: float) -> float:
    number = finite(value)
    return default if number is None else number


def flight_row(message: dict[str, Any], run_ids: RunIds) -> dict[str, Any]:
    """A flight window (JSON-safe) with its evidence precomputed for the verdict."""
    body = message["body"]
    raw = body["flight"] if isinstance(body["flight"], dict) else {}
    data = jsonable(raw)
    if isinstance(data, dict):
        # JSON keeps no NaN/inf: say where they were, apart from "not recorded" (null).
        data["act_nonfinite"] = nonfinite_cells(raw.get("act_max_abs"))
        data["grad_nonfinite"] = nonfinite_cells(raw.get("grad_max_abs"))
    evidence = flight_evidence(data if isinstance(data, dict) else {})
    low, high = magnitudes(raw)
    return {
        "run_id": run_ids.of(message),
        "rank": message["rank"],
        "time": message["time"],
        "reason": clean_str(body.get("reason"), 500),
        "data": data,
        "overflow": evidence.overflow,
        "grad_rising": evidence.grad_rising,
        "evidence": clean_str(evidence.text, 500),
        "mag_min": low,
        "mag_max": high,
    }


def _cells(matrix: Any) -> list[tuple[int, int, Any]]:
    rows = matrix if isinstance(matrix, list) else []
    return [
        (i, j, v) for i, row in enumerate(rows) if isinstance(row, list) for j, v in enumerate(row)
    ]


def nonfinite_cells(matrix: Any) -> list[list[int]]:
    """``[step index, module index]`` of every NaN/inf cell of a flight matrix.

    >>> nonfinite_cells([[1.0, None], [float("inf"), 2.0]])
    [[1, 0]]
    """
    return [[i, j] for i, j, v in _cells(matrix) if isinstance(v, float) and not math.isfinite(v)]


def magnitudes(flight: dict[str, Any]) -> tuple[float | None, float | None]:
    """The smallest and largest positive finite max|x| of a window (both views),
    so every rank's heatmap can share one colour scale."""
    values = [
        float(v)
        for key in ("act_max_abs", "grad_max_abs")
        for _, _, v in _cells(flight.get(key))
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    ]
    return (min(values), max(values)) if values else (None, None)


def _bool_or_none(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None
