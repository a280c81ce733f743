"""The agent's own bugs never reach the training loop.

Every hook and step-boundary routine checks :attr:`Guard.off` first and
hands what it catches to :meth:`Guard.failed`: an unexpected exception
inside nand is logged once, with its traceback, and the agent switches
itself off (a half-recorded step would give wrong answers later).
Exceptions nand raises on purpose (:class:`~nand.errors.NandError`:
``NonFiniteError``, ``StopRequested``) pass.

A collective of nand's own (the agreed flag, the shard check) that fails
because another rank is gone is not nand's bug either: :class:`PeerGone`
says so in one line, without a traceback, and the agent switches off (the
process group is broken; the training's own next collective fails too).

One place is not looked into, and an error there is not nand's: a
``torch.func`` transform (``vmap``, ``grad``: per-sample gradients). The
values inside are batched wrappers that no probe can reduce into the step's
buffer; a hook that fails there leaves them unchecked, says so once, and
the agent stays on (the gradients the transform's result is turned into
are checked at the optimizer step like any others).
"""

from __future__ import annotations

import logging

from torch._C._functorch import peek_interpreter_stack

from nand.errors import NandError

log = logging.getLogger("nand")


class PeerGone(RuntimeError):
    """A collective nand runs at the step boundary failed: another rank died
    (killed, out of memory) or left; the collective library says which."""


class Guard:
    """Shared on/off switch of one ``Watch``; ``off`` is read by every hook."""

    __slots__ = ("error", "off", "transform_seen")

    def __init__(self) -> None:
        self.off = False
        self.error: BaseException | None = None
        self.transform_seen = False

    def failed(self, exc: BaseException, where: str) -> None:
        """Record an internal error: log it once, turn the agent off (unless
        it was raised inside a ``torch.func`` transform: see the module)."""
        if isinstance(exc, NandError):
            raise exc
        if peek_interpreter_stack() is not None:  # inside a torch.func transform
            self._in_transform(where)
            return
        if self.error is None and isinstance(exc, PeerGone):
            self.error = exc
            log.warning(
                "nand: another rank is gone (%s failed: %s); nand switched itself off",
                where,
                exc,
            )
        elif self.error is None:
            self.error = exc
            log.error(
                "nand: internal error in %s; nand switched itself off, training goes on",
                where,
                exc_info=exc,
            )
        self.off = True

    def _in_transform(self, where: str) -> None:
        if not self.transform_seen:
            self.transform_seen = True
            log.warning(
                "nand: the %s ran inside a torch.func transform (vmap, grad); nand does not "
                "look inside those: the gradients made from them are checked at the optimizer step",
                where,
            )
