"""Early warning of a blow-up, before anything is non-finite.

Most NaNs are the end of a blow-up that could be seen coming: the loss
spikes, the gradient norm grows by orders of magnitude, an activation marches
toward its dtype's largest value. :class:`BlowUpWatch` looks at the figures
the step's one read already holds (no tensor, no sync) and returns
:class:`~nand.events.Alert` s, never incidents:

- ``loss_spike``: the loss above :data:`LOSS_RTOL` + 1 times the mean of the
  last :data:`LOSS_WINDOW` finite losses (the rule of Lightning's
  ``SpikeDetection``: a relative tolerance over a running mean);
- ``grad_growth``: the global gradient norm above :data:`GRAD_GROWTH` times
  the median of the last :data:`GRAD_WINDOW` steps';
- ``headroom``: a layer's output within 2x of its dtype's largest value
  (``analysis.near_limit``).

Nothing is compared before :data:`WARMUP` figures are in, a spiking figure
does not enter the window it is judged against (so a run of spikes is still
seen as one), and each kind warns once per :data:`QUIET_STEPS`: ``headroom``
too, whichever layer it names (the first one near the limit; in the light
mode, where layers are sampled in turn, the one sampled first that step, so a
value carried through three layers would otherwise warn three times).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from nand.agent.step.analysis import StepRow, near_limit
from nand.events import Alert

LOSS_WINDOW = 20
LOSS_RTOL = 2.0
GRAD_WINDOW = 50
GRAD_GROWTH = 10.0
WARMUP = 10
QUIET_STEPS = 100
MEDIAN_EVERY = 10


class BlowUpWatch:
    """The recent losses and gradient norms of one rank, and what they say."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.grad_norms: deque[float] = deque(maxlen=GRAD_WINDOW)
        self._median = 0.0  # of grad_norms, recomputed every MEDIAN_EVERY steps
        self._stale = 0
        self._last: dict[str, int] = {}  # kind -> step warned

    def look(self, row: StepRow, n_pairs: int, grad_norm: float | None, clean: bool) -> list[Alert]:
        """This step's alerts (usually none: a few comparisons). A step that
        already went non-finite (``clean`` false) is an incident: only its
        headroom is looked at, and its figures stay out of the windows."""
        alerts = [self._headroom(row, n_pairs)]
        if clean:
            alerts += [self._loss(row.step, row.loss), self._grads(row.step, grad_norm)]
        if alerts.count(None) == len(alerts):  # (most steps: a C loop, nothing to filter)
            return []
        return [a for a in alerts if a is not None and self._due(a)]

    def _loss(self, step: int, loss: float | None) -> Alert | None:
        if loss is None or not math.isfinite(loss):
            return None
        window = self.losses
        mean = sum(window) / len(window) if window else 0.0
        if len(window) >= WARMUP and mean > 0 and loss > (1 + LOSS_RTOL) * mean:
            return Alert(
                kind="loss_spike",
                step=step,
                rank=self.rank,
                value=loss,
                reference=mean,
                message=(
                    f"loss spike at step {step}: {loss:.4g}, {loss / mean:.1f}x the mean of the "
                    f"last {len(window)} steps ({mean:.4g}); still finite"
                ),
            )
        window.append(loss)
        return None

    def _grads(self, step: int, norm: float | None) -> Alert | None:
        if norm is None or not math.isfinite(norm):
            return None
        window = self.grad_norms
        median = self._grad_median()
        if median > 0 and norm > GRAD_GROWTH * median:
            return Alert(
                kind="grad_growth",
                step=step,
                rank=self.rank,
                value=norm,
                reference=median,
                message=(
                    f"gradient norm growing at step {step}: {norm:.4g}, {norm / median:.0f}x the "
                    f"median of the last {len(window)} steps ({median:.4g}); still finite"
                ),
            )
        window.append(norm)
        return None

    def _grad_median(self) -> float:
        """The window's median, recomputed every :data:`MEDIAN_EVERY` steps
        (it moves slowly; a sort of 50 floats every step is what it saves)."""
        if len(self.grad_norms) < WARMUP:
            return 0.0
        self._stale -= 1
        if self._stale <= 0:
            self._median = statistics.median(self.grad_norms)
            self._stale = MEDIAN_EVERY
        return self._median

    def _headroom(self, row: StepRow, n_pairs: int) -> Alert | None:
        near = near_limit(row, n_pairs) if n_pairs else None
        if near is None:
            return None
        site, value = near
        limit = torch.finfo(site.dtype).max if site.dtype is not None else math.inf
        dtype = str(site.dtype).removeprefix("torch.")
        where = f"{site.module or '<root>'} ({site.module_type})"
        return Alert(
            kind="headroom",
            step=row.step,
            rank=self.rank,
            module=site.module,
            value=value,
            reference=limit,
            message=(
                f"overflow headroom: {where} reached max |x| {value:.4g} at step {row.step}, "
                f"{100 * value / limit:.0f}% of the {dtype} limit {limit:.4g}; still finite, "
                "but close to overflowing"
            ),
        )

    def _due(self, alert: Alert) -> bool:
        """Once per kind per QUIET_STEPS steps (see the module)."""
        key = alert.kind
        last = self._last.get(key)
        if last is not None and alert.step - last < QUIET_STEPS:
            return False
        self._last[key] = alert.step
        return True


def global_norm(norms: list[float], span: tuple[int, int] | None, scale: float) -> float | None:
    """The gradients' global 2-norm from their per-tensor norms (unscaled)."""
    if span is None or not span[1]:
        return None
    start, n = span
    return math.hypot(*norms[start : start + n]) / (scale or 1.0)
