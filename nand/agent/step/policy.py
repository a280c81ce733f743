"""What a rank does with a non-finite step, before the update: ``on_nonfinite``.

- ``warn``: nothing more (the incident was logged and sent). In the light
  mode, read one step late, the update was skipped on the device all the
  same, so that the step can be replayed with its weights (``on_device``;
  see ``deferred.read_mode``); that is logged.
- ``skip``: drop the update (every ``.grad`` set to ``None``) and go on.
  Deferred (``read``), the update was skipped on the device already, through
  the fused optimizer's ``found_inf``; the outcome read one step late is logged.
- ``raise``: :class:`~nand.errors.NonFiniteError` out of ``optimizer.step()``.
- ``stop``: ``raise`` agreed by every rank; a rank that only received the
  value, or saw nothing, raises :class:`~nand.errors.StopRequested`.

With ``on_stop`` (the framework integrations) ``raise``/``stop`` end the
framework's loop instead: the update is skipped and ``on_stop()`` is called
once (Lightning's ``trainer.should_stop``, HF's ``control.should_training_stop``).

Early warnings (``on_warning``, :meth:`StepPolicy.alerted`) are reported, and
then ``log`` (nothing more), ``raise`` (:class:`~nand.errors.EarlyWarning`) or
``skip`` (drop the update, read in sync; a deferred read learns of it a step
late and only says so).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nand.agent.step.window import Outcome
from nand.config import WarningPolicy
from nand.errors import EarlyWarning, NandError, NonFiniteError, StopRequested
from nand.events import Alert
from nand.policy import OnNonfinite

log = logging.getLogger("nand")


class StepPolicy:
    def __init__(
        self,
        policy: OnNonfinite,
        *,
        drop_grads: Callable[[], None],
        on_stop: Callable[[], None] | None,
        on_warning: WarningPolicy = "log",
        lagged: bool = False,
        on_device: bool = False,
    ) -> None:
        self.policy = policy
        self.on_warning = on_warning
        self.drop_grads = drop_grads
        self.on_stop = on_stop
        self._stopping = False
        #: Deferred read: the outcome is the previous step's, whose update was
        #: already skipped on the device (``skip``) or applied (``warn``).
        self.lagged = lagged
        #: Deferred: a non-finite step's update is skipped on the device, whatever the policy.
        self.on_device = on_device

    @property
    def raises(self) -> bool:
        """Whether a non-finite step ends training (``raise`` or ``stop``)."""
        return self.policy.raises

    def act(self, outcome: Outcome, step: int) -> None:
        """What the step boundary read (before the update): a GradScaler
        overflow, a non-finite step (``on_nonfinite``) or early warnings."""
        if outcome.overflow:
            if not self.lagged:
                self.drop_grads()  # a fused optimizer got found_inf; nothing to apply
        elif outcome.event is not None or outcome.any_rank_bad:
            self.apply(outcome, step)
        else:  # early warnings of a clean step (step/blowup.py)
            self.alerted(outcome.alerts, step)

    def apply(self, outcome: Outcome, step: int) -> None:
        """A non-finite step (here or, agreed, on another rank)."""
        event = outcome.event
        if not self.policy.acts:
            if self.on_device and self.lagged:  # (warn in the light mode)
                log.warning("nand: skipped optimizer step %d on the device (non-finite)", step)
            return
        if self.policy.skips_update:
            if not self.lagged:
                self.drop_grads()
            where = " on the device" if self.lagged else ""
            log.warning("nand: skipped optimizer step %d%s (non-finite)", step, where)
        elif self.policy is OnNonfinite.RAISE and event is not None:
            raise NonFiniteError(event)
        elif event is not None and event.cause != "received":
            self.stop(NonFiniteError(event), step)
        else:  # (stop) this rank only received it, or another rank saw it
            self.stop(StopRequested(step, "a non-finite value on another rank"), step)

    def alerted(self, alerts: tuple[Alert, ...], step: int) -> None:
        """Early warnings of this step (already reported): ``on_warning``."""
        if not alerts or self.on_warning == "log":
            return
        if self.on_warning == "raise":
            raise EarlyWarning(alerts[0])
        if self.lagged:
            log.warning("nand: step %d warned, read one step late: not skipped", step)
        else:
            self.drop_grads()
            log.warning("nand: skipped optimizer step %d (%s)", step, alerts[0].kind)

    def stop(self, error: NandError, step: int) -> None:
        """End training at this step boundary, before the update: raise
        ``error``, or skip the update and call ``on_stop`` (once)."""
        if self.on_stop is None:
            raise error
        self.drop_grads()
        if not self._stopping:
            self._stopping = True
            log.warning("nand: stopping training at step %d: %s", step, error)
            self.on_stop()
