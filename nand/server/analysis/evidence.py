"""What a flight-recorder window says: overflow and gradient explosion.

Computed once at ingest (stored with the window in ``flights``) so the verdict
reads three small columns, never the window itself.

>>> w = {"steps": [1, 2, 3], "act_max_abs": [[2.0], [900.0], [3e4]], "dtype_max": 65504.0}
>>> flight_evidence(w).overflow
True
>>> runaway = {"steps": [1, 2], "act_max_abs": [[3.0], [2e17]], "dtype_max": 3.4e38}
>>> flight_evidence(runaway).overflow
True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Overflow: the window's largest finite max|x| reached this share of the dtype's limit...
OVERFLOW_SHARE = 0.1
#: ...or grew at least this many times over the window (a runaway: in float32 a
#: blow-up jumps from ~1e17 to inf in one step, never near the limit itself).
RUNAWAY_FACTOR = 1e6
#: Gradient explosion: the grad norm grew at least this much over the window...
EXPLOSION_FACTOR = 10.0
#: ...rising on at least this share of consecutive steps.
EXPLOSION_RISING_SHARE = 2 / 3


#: The largest finite value of each floating dtype, by the name events carry.
DTYPE_LIMITS = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}


def dtype_limit(dtype: str) -> float | None:
    return DTYPE_LIMITS.get(dtype.removeprefix("torch."))


@dataclass(frozen=True)
class FlightEvidence:
    overflow: bool = False
    grad_rising: bool = False
    #: One phrase for the summary, e.g. "max |x| rose from 3 to 6.1e+04 (float16 limit 65504)".
    text: str = ""


def flight_evidence(flight: dict[str, Any]) -> FlightEvidence:
    """What a flight-recorder window says about overflow and gradient growth."""
    steps = [s for s in flight.get("steps") or [] if isinstance(s, int)]
    overflow_text = _overflow(flight, steps)
    rising_text = _grad_rising(flight.get("grad_norm") or [], steps)
    return FlightEvidence(
        overflow=bool(overflow_text),
        grad_rising=bool(rising_text),
        text=overflow_text or rising_text,
    )


def _finite(values: Any) -> list[float]:
    if not isinstance(values, list | tuple):
        return []
    return [
        float(v)
        for v in values
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _span(steps: list[int]) -> str:
    return f" over steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else ""


def _overflow(flight: dict[str, Any], steps: list[int]) -> str:
    """Peak finite max|x| per step (activations and gradients) near the dtype's
    limit, or one layer's max|x| running away over the window."""
    limit = flight.get("dtype_max")
    if not isinstance(limit, int | float) or not math.isfinite(limit) or limit <= 0:
        return ""
    act = _rows(flight.get("act_max_abs"))
    grad = _rows(flight.get("grad_max_abs"))
    n = max(len(act), len(grad))
    act, grad = act + [[]] * (n - len(act)), grad + [[]] * (n - len(grad))
    peaks = [max(_finite(a) + _finite(g), default=0.0) for a, g in zip(act, grad, strict=True)]
    peaks = [p for p in peaks if p > 0]
    rose: tuple[float, float] | None = None
    if peaks and max(peaks) > peaks[0] and max(peaks) >= OVERFLOW_SHARE * limit:
        rose = (peaks[0], max(peaks))
    else:
        rose = _runaway(act) or _runaway(grad)
    if rose is None:
        return ""
    dtype = flight.get("dtype") or "dtype"
    first, top = rose
    return f"max |x| rose from {first:.3g} to {top:.3g} ({dtype} limit {limit:.6g}){_span(steps)}"


def _runaway(rows: list[list[Any]]) -> tuple[float, float] | None:
    """A layer whose max|x| grew :data:`RUNAWAY_FACTOR` times over the window:
    (its first figure, its largest). Each layer against itself: the light
    mode's rows are a rotating sample (cells not sampled are None), and two
    steps' peaks over different layers are not comparable."""
    for column in itertools.zip_longest(*rows):
        values = [v for v in _finite(list(column)) if v > 0]
        if values and max(values) >= RUNAWAY_FACTOR * values[0]:
            return values[0], max(values)
    return None


def _rows(rows: Any) -> list[list[Any]]:
    return [r if isinstance(r, list) else [] for r in rows] if isinstance(rows, list) else []


def _grad_rising(grad_norm: Sequence[Any], steps: list[int]) -> str:
    values = _finite(grad_norm)
    if len(values) < 3 or values[0] <= 0 or values[-1] < EXPLOSION_FACTOR * values[0]:
        return ""
    ups = sum(b > a for a, b in itertools.pairwise(values))
    if ups < EXPLOSION_RISING_SHARE * (len(values) - 1):
        return ""
    return f"gradient norm rose from {values[0]:.3g} to {values[-1]:.3g}{_span(steps)}"


def heartbeat_evidence(points: Sequence[tuple[int, float | None]]) -> FlightEvidence:
    """Gradient growth from heartbeats ``(step, grad_norm)``, oldest first: the
    fallback when the origin rank sent no flight-recorder window."""
    text = _grad_rising([g for _, g in points], [s for s, _ in points])
    return FlightEvidence(grad_rising=bool(text), text=text)
