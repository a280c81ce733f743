"""``torch.amp.GradScaler`` awareness.

With a scaler, gradients are multiplied by the loss scale, and a step whose
scaled gradients overflowed is skipped *on purpose*: the scaler never calls
``optimizer.step()`` (or, with a fused optimizer, passes ``found_inf``), then
halves the scale in ``update()``. Such steps are not incidents: they are
counted, and a warning is logged only when the scale keeps collapsing.

``GradScaler`` has no hooks, so ``update`` is wrapped on the instance (the
wrapper is removed by ``close``): when ``update`` runs and the optimizer's
pre-hook did not, the step was skipped, and the step boundary runs from here.
Reported gradient figures are divided by the scale that was in effect.

Nobody needs to tell nand which scaler is in use: Lightning
(``precision="16-mixed"``), HF ``Trainer`` (``fp16=True``) and accelerate
create their own. While a watch with an optimizer is open, ``GradScaler.step``
is wrapped on the class (``nand/agent/patches.py``, which owns every change
nand makes to the process): when a scaler steps a watched optimizer, that
watch adopts it (:class:`AmpWatch`), before the scaler unscales or steps anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("nand")

#: Consecutive overflow-skipped steps after which the scale "keeps collapsing"
#: (halving from 2**16 takes 16 steps to reach 1; more means something is wrong).
COLLAPSE_STEPS = 50
#: A loss scale below this means the gradients overflow even unscaled.
COLLAPSE_SCALE = 1.0


class AmpWatch:
    def __init__(
        self,
        scaler: Any,
        optimizer: Any,
        stepped: Callable[[], bool],
        skipped_step: Callable[[], None],
    ) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        self.stepped = stepped  # did the optimizer step since the last update? (clears)
        self.skipped_step = skipped_step
        self.skipped = 0  # overflow-skipped steps so far
        self.consecutive = 0
        self.scale = 1.0  # the scale of the step read last
        self.warned = False
        self._update = scaler.update
        scaler.update = self._wrapped_update

    def close(self) -> None:
        if self.scaler.__dict__.get("update") == self._wrapped_update:
            del self.scaler.update

    def enabled(self) -> bool:
        return bool(self.scaler.is_enabled())

    def extras(self) -> list[Tensor]:
        """[scale, found_inf] as 0-d device tensors, for the step's one read."""
        scale = getattr(self.scaler, "_scale", None)
        if scale is None or not self.enabled():
            return []
        state = self.scaler._per_optimizer_states.get(id(self.optimizer), {})
        found = list(state.get("found_inf_per_device", {}).values())
        found_inf = torch.stack([f.to(scale.device) for f in found]).sum() if found else scale * 0
        return [scale.reshape(()), found_inf.reshape(())]

    def grads_scaled(self) -> bool:
        """Whether ``.grad`` still holds scaled values (fused optimizers)."""
        state = self.scaler._per_optimizer_states.get(id(self.optimizer), {})
        stage = state.get("stage")
        return stage is not None and getattr(stage, "name", "") != "UNSCALED"

    def record(self, scale: float, overflow: bool) -> None:
        self.scale = scale if scale > 0 else 1.0
        if overflow:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
            self.warned = False

    def warn_if_collapsing(self, first_nonfinite: str | None) -> None:
        """Log once per collapse (many skips in a row, or a scale below 1):
        overflow then is no longer the scaler finding its range."""
        if self.warned or not self.consecutive:
            return
        if self.consecutive >= COLLAPSE_STEPS or self.scale < COLLAPSE_SCALE:
            self.warned = True
            log.warning(
                "nand: the AMP loss scale keeps collapsing: %d overflow steps in a row, "
                "scale %.3g%s",
                self.consecutive,
                self.scale,
                f"; first non-finite: {first_nonfinite}" if first_nonfinite else "",
            )

    def _wrapped_update(self, new_scale: Any = None) -> None:
        if not self.stepped():
            self.skipped_step()
        self._update(new_scale)


def amp_figures(
    watch: AmpWatch | None, values: list[float], extras: list[str], skipped: bool, scaled: bool
) -> tuple[float, float, bool]:
    """(loss scale, the scale the gradient norms carry, overflow) of a window
    read (``skipped``: the scaler skipped its step; ``scaled``: its gradient
    norms still carry the scale), recorded on ``watch``; 1.0s without a scaler."""
    if watch is None or "scale" not in extras:  # a scaler that is disabled
        return 1.0, 1.0, False
    at = len(values) - len(extras)
    scale, found_inf = values[at], values[at + 1]
    overflow = skipped or found_inf > 0
    watch.record(scale, overflow)
    norm_scale = scale if scaled else 1.0
    return (scale if scale > 0 else 1.0), (norm_scale if norm_scale > 0 else 1.0), overflow
