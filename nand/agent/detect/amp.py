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
is wrapped on the class (:func:`listen`): when a scaler steps a watched
optimizer, that watch adopts it, before the scaler unscales or steps anything.
The class is restored when the last such watch is closed or, never closed,
garbage collected (its model and optimizer gone).
"""

from __future__ import annotations

import logging
import weakref
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


#: The class whose ``step`` meets the optimizer (torch.cuda.amp's subclasses it).
_SCALER_CLASS: Any = torch.amp.GradScaler
#: id(optimizer) -> the watch's "a scaler steps my optimizer" method, held weakly.
_listeners: dict[int, weakref.WeakMethod[Callable[[Any], None]]] = {}
_original_step: Any = None


def listen(optimizer: Any, adopt: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``adopt(scaler)`` whenever a GradScaler steps ``optimizer``; returns
    the function that stops listening. The wrap comes off the class with the
    last listener: at its ``close``, or once its watch is garbage collected
    (a watch never closed must not leave the class patched for the process)."""
    global _original_step
    if _original_step is None:
        _original_step = _SCALER_CLASS.step
        _SCALER_CLASS.step = _scaler_step
    key = id(optimizer)
    reference = weakref.WeakMethod(adopt)
    _listeners[key] = reference

    def unlisten() -> None:
        if _listeners.get(key) is reference:  # (not a later watch's of the same optimizer)
            del _listeners[key]
        _restore_when_unheard()

    # Held by weakref's registry, not by the watch: runs when the watch is collected.
    collected = weakref.finalize(getattr(adopt, "__self__", adopt), unlisten)
    collected.atexit = False
    return unlisten


def _restore_when_unheard() -> None:
    """Put ``GradScaler.step`` back once no live watch listens."""
    global _original_step
    if any(reference() is not None for reference in list(_listeners.values())):
        return
    _listeners.clear()  # (only watches that are gone)
    if _original_step is not None:
        if _SCALER_CLASS.__dict__.get("step") is _scaler_step:
            _SCALER_CLASS.step = _original_step
        _original_step = None


def _scaler_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """``GradScaler.step`` while a watch listens: tell it, then step as usual."""
    reference = _listeners.get(id(optimizer))
    adopt = reference() if reference is not None else None
    if adopt is not None:
        adopt(self)  # guarded by the watch: never raises into the loop
    return _original_step(self, optimizer, *args, **kwargs)
