"""The agent's own bugs never reach the training loop.

Every hook and step-boundary routine runs under :func:`Guard.run` or checks
:attr:`Guard.off`: an unexpected exception inside nand is logged once, with
its traceback, and the agent switches itself off (a half-recorded step would
give wrong answers later). Exceptions nand raises on purpose
(:class:`~nand.errors.NandError`: ``NonFiniteError``, ``StopRequested``) pass.
"""

from __future__ import annotations

import logging

from nand.errors import NandError

log = logging.getLogger("nand")


class Guard:
    """Shared on/off switch of one ``Watch``; ``off`` is read by every hook."""

    __slots__ = ("error", "off")

    def __init__(self) -> None:
        self.off = False
        self.error: BaseException | None = None

    def failed(self, exc: BaseException, where: str) -> None:
        """Record an internal error: log it once, turn the agent off."""
        if isinstance(exc, NandError):
            raise exc
        if self.error is None:
            self.error = exc
            log.error(
                "nand: internal error in %s; nand switched itself off, training goes on",
                where,
                exc_info=exc,
            )
        self.off = True
