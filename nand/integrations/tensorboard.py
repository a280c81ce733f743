"""Incidents in TensorBoard: ``nand.watch(..., on_event=to_tensorboard(writer))``.

>>> from torch.utils.tensorboard import SummaryWriter
>>> from nand.integrations.tensorboard import to_tensorboard
>>> writer = SummaryWriter("runs/exp1")                             # doctest: +SKIP
>>> watch = nand.watch(model, opt, on_event=to_tensorboard(writer))  # doctest: +SKIP

Each incident and early warning of this rank (see ``nand.integrations.tracking``)
is written at its step (nand's ``step`` plus ``offset``: the step at which the
loop logs that update's loss; HF's ``Trainer`` logs it one later), so the
loss curve and the incident are on one page:

- text ``nand/incident`` or ``nand/warning`` (the sentence nand logs), under *Text*;
- scalar ``nand/incident`` or ``nand/warning`` = 1, under *Scalars*, next to the loss.

The writer is ``writer`` (a ``torch.utils.tensorboard`` or ``tensorboardX``
``SummaryWriter``: your own, or your trainer's), else a ``SummaryWriter`` on
``log_dir`` made at the first report. It is flushed after each report: an
incident is often the last thing a job says. ``pip install 'nand-torch[tensorboard]'``.
"""

from __future__ import annotations

from typing import Any

from nand.integrations.tracking import Report, kind, text

__all__ = ["TensorBoardBridge", "to_tensorboard"]


class TensorBoardBridge:
    """An ``on_event`` callable that writes to a TensorBoard ``SummaryWriter``; see the module."""

    def __init__(self, writer: Any = None, *, log_dir: str | None = None, offset: int = 0) -> None:
        self.writer = writer
        self.log_dir = log_dir
        self.offset = offset

    def __call__(self, report: Report) -> None:
        writer = self._writer()
        step = report.step + self.offset
        tag = f"nand/{kind(report)}"
        writer.add_text(tag, text(report), global_step=step)
        writer.add_scalar(tag, 1.0, global_step=step)
        writer.flush()

    def _writer(self) -> Any:
        if self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(
                    "to_tensorboard needs TensorBoard: "
                    f"pip install 'nand-torch[tensorboard]' ({exc})"
                ) from exc
            self.writer = SummaryWriter(log_dir=self.log_dir)
        return self.writer


def to_tensorboard(
    writer: Any = None, *, log_dir: str | None = None, offset: int = 0
) -> TensorBoardBridge:
    """The ``on_event`` callable for TensorBoard: ``writer``, else one on ``log_dir``."""
    return TensorBoardBridge(writer, log_dir=log_dir, offset=offset)
