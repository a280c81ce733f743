"""The flight recorder: per-module telemetry of the last N steps, bounded.

Fed by the same device reductions that detect non-finite values (nothing is
computed for it alone), one row per optimizer step, in a ring buffer. An
incident ships :meth:`FlightRecorder.window` with its first event, so a
person can see whether activations or gradients were growing before it.
"""

from __future__ import annotations

from collections import deque

from nand.events import FlightWindow

Row = tuple[int, list[float | None], list[float | None], float | None, float | None]


def _finite(value: float | None) -> float | None:
    # JSON/msgpack consumers want numbers; a non-finite figure is the event's job.
    return value if value is None or abs(value) < float("inf") else None


class FlightRecorder:
    """A ring buffer of (step, act max|x|, grad max|x|, grad norm, loss)."""

    def __init__(self, steps: int, modules: list[str]) -> None:
        self.modules = modules
        self.rows: deque[Row] = deque(maxlen=max(1, steps))
        self.dtype = ""
        self.dtype_max: float | None = None

    def push(
        self,
        step: int,
        act: list[float | None],
        grad: list[float | None],
        grad_norm: float | None,
        loss: float | None,
    ) -> None:
        self.rows.append((step, act, grad, grad_norm, loss))

    def window(self) -> FlightWindow:
        rows = list(self.rows)
        return FlightWindow(
            steps=[r[0] for r in rows],
            modules=list(self.modules),
            act_max_abs=[[_finite(v) for v in r[1]] for r in rows],
            grad_max_abs=[[_finite(v) for v in r[2]] for r in rows],
            grad_norm=[_finite(r[3]) for r in rows],
            loss=[_finite(r[4]) for r in rows],
            dtype=self.dtype,
            dtype_max=self.dtype_max,
        )
