"""Every exception nand raises, in one hierarchy::

    NandError                     anything nand raises on purpose
    ├── NonFiniteError            a watched run went non-finite (on_nonfinite="raise"/"stop")
    ├── EarlyWarning              on_warning="raise": heading for a blow-up, still finite (.alert)
    ├── StopRequested             the server or the ranks agreed to stop at a step boundary
    ├── WireError                 a message that does not decode or validate (has .reason)
    ├── SpoolCorruptError         a spool file whose bytes are not what its format says
    ├── ConfigError               a NAND_* setting or argument that makes no sense
    └── CommandError              a command-line failure: one line with the fix, an exit code

``NonFiniteError`` carries the :class:`nand.Event` that caused it as ``.event``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nand.events import Alert, Event


class NandError(Exception):
    """Base class of every error nand raises on purpose."""


class NonFiniteError(NandError):
    """The watched model went non-finite; ``.event`` says where first."""

    def __init__(self, event: Event, message: str | None = None) -> None:
        self.event = event
        super().__init__(message or event.message or event.describe())


class EarlyWarning(NandError):
    """``on_warning="raise"``: the run is heading for a blow-up (``.alert``
    says what was seen: a loss spike, a growing gradient norm, an activation
    near its dtype's limit); everything is still finite."""

    def __init__(self, alert: Alert) -> None:
        self.alert = alert
        super().__init__(alert.message)


class StopRequested(NandError):
    """Training was asked to stop at ``.step`` (by the server, or agreed by all ranks)."""

    def __init__(self, step: int, reason: str = "") -> None:
        self.step = step
        self.reason = reason
        super().__init__(f"stop requested at step {step}" + (f": {reason}" if reason else ""))


class WireError(NandError):
    """A message that could not be decoded or validated.

    ``.reason`` is a short stable code (``too_large``, ``not_msgpack``,
    ``bad_version``, ...) that the server counts in ``/metrics``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class SpoolCorruptError(NandError):
    """A spool file is corrupt beyond a torn tail (which is tolerated)."""


class ConfigError(NandError, ValueError):
    """A setting or argument that makes no sense, with what to do about it."""


class CommandError(NandError):
    """What a ``nand`` command could not do, said in one line with what to do about it.

    The command line prints ``nand: <message>`` on stderr and exits with
    ``.exit_code`` (one of :mod:`nand.exitcodes`); the traceback only with ``-v``.

    >>> from nand import exitcodes
    >>> err = CommandError("port 8080 is in use; pass --http :8081", exitcodes.ADDRESS_IN_USE)
    >>> err.exit_code, str(err)
    (11, 'port 8080 is in use; pass --http :8081')
    """

    def __init__(self, message: str, exit_code: int) -> None:
        self.exit_code = exit_code
        super().__init__(message)
