"""The flight recorder: per-module telemetry of the last N steps, bounded.

Fed by the same device reductions that detect non-finite values (nothing is
computed for it alone): each step's raw figures, as read, go into a ring
buffer of :class:`~nand.agent.step.analysis.StepRow`. They are turned into the
per-module matrices of a :class:`~nand.events.FlightWindow` only when a window
is asked for (an incident, a server request), so a healthy step pays one
``deque.append``.

Under DDP it also keeps each step's local gradient norm (this rank's own,
before the all-reduce; ``detect.ddp``) until a heartbeat carries it to the
server, which compares the ranks (``nand.server.analysis.outliers``): at most
:data:`LOCAL_NORMS_KEPT` steps between two heartbeats, the latest.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import nn

from nand.agent.detect.amp import AmpWatch
from nand.agent.step.analysis import StepRow, Telemetry, telemetry
from nand.events import FlightWindow, StepSummary

#: Local gradient norms kept between two heartbeats (at more steps per
#: heartbeat period the oldest go uncompared). The wire takes no more.
LOCAL_NORMS_KEPT = 256


def _finite(value: float | None) -> float | None:
    # JSON/msgpack consumers want numbers; a non-finite figure is the event's job.
    return value if value is None or abs(value) < float("inf") else None


class FlightRecorder:
    """A ring buffer of the last ``steps`` step rows."""

    def __init__(self, steps: int, modules: list[str]) -> None:
        self.modules = modules
        self.rows: deque[StepRow] = deque(maxlen=max(1, steps))
        self.dtype = ""
        self.dtype_max: float | None = None
        #: ``(step, local gradient norm)`` not yet sent (DDP only).
        self.local_norms: deque[tuple[int, float]] = deque(maxlen=LOCAL_NORMS_KEPT)

    def local_norm(self, step: int, norm: float) -> None:
        """This step's local gradient norm (a non-finite one is an event's job)."""
        if math.isfinite(norm):
            self.local_norms.append((step, norm))

    def set_dtype(self, dtype: torch.dtype) -> None:
        """The model's dtype, with its limit: the scale telemetry is read against."""
        self.dtype = str(dtype).removeprefix("torch.")
        self.dtype_max = float(torch.finfo(dtype).max)

    def set_dtype_of(self, model: nn.Module) -> None:
        """The dtype of ``model``'s first floating parameter, if it has one."""
        p = next((p for p in model.parameters() if p.is_floating_point()), None)
        if p is not None:
            self.set_dtype(p.dtype)

    def summary(self, step: int, steps_per_s: float, amp: AmpWatch | None) -> StepSummary:
        """A heartbeat's figures, from what the last steps already read."""
        tele = self.last()
        rows = self.rows
        return StepSummary(
            step=step,
            steps_per_s=steps_per_s,
            loss=rows[-1].loss if rows else None,
            grad_norm=tele.grad_norm if tele else None,
            max_activation=tele.max_act if tele else None,
            amp_skipped=amp.skipped if amp is not None else 0,
            amp_scale=amp.scale if amp is not None else None,
            local_grad_norms=self._take_local_norms(),
        )

    def _take_local_norms(self) -> list[tuple[int, float]] | None:
        if not self.local_norms:
            return None
        taken = list(self.local_norms)
        self.local_norms.clear()
        return taken

    def last(self) -> Telemetry | None:
        return telemetry(self.rows[-1], len(self.modules)) if self.rows else None

    def window(self) -> FlightWindow:
        rows = list(self.rows)
        tele = [telemetry(r, len(self.modules)) for r in rows]
        return FlightWindow(
            steps=[r.step for r in rows],
            modules=list(self.modules),
            act_max_abs=[[_finite(v) for v in t.act] for t in tele],
            grad_max_abs=[[_finite(v) for v in t.grad] for t in tele],
            grad_norm=[_finite(t.grad_norm) for t in tele],
            loss=[_finite(r.loss) for r in rows],
            dtype=self.dtype,
            dtype_max=self.dtype_max,
        )
