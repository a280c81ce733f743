"""Incidents in Weights & Biases: ``nand.watch(..., on_event=to_wandb())``.

>>> import wandb, nand
>>> from nand.integrations.wandb import to_wandb
>>> run = wandb.init(project="my-project")                 # doctest: +SKIP
>>> watch = nand.watch(model, opt, on_event=to_wandb())    # doctest: +SKIP

Each incident and early warning of this rank (see ``nand.integrations.tracking``) becomes

- a W&B alert (``run.alert``): level ``ERROR`` for an incident, ``WARN`` for
  a warning. Offline (``WANDB_MODE=offline``) it is kept in the run's file
  and goes out with ``wandb sync``;
- the run summary's ``nand/state``, ``nand/origin``, ``nand/step``, set when
  the state gets worse (first warning, first incident), so the runs table
  shows which runs went bad, where and when;
- ``nand/incident`` or ``nand/warning`` = 1 in the history. In a loop of
  yours it goes into the row the loop logs next (``commit=False``: nand adds
  no row, so the loop's step numbering stays as it is). With ``step_metric``
  (the frameworks' x axis: HF's ``train/global_step``, Lightning's
  ``trainer/global_step``) it is a row of its own carrying nand's step (plus
  ``offset``) under that key, so it sits at its step on those charts even
  when reported a step late (the deferred read).

The run is ``run``, else the active ``wandb.run`` when a report comes (so
``to_wandb()`` can be made before ``wandb.init``); with neither, it says so
once and writes nothing. W&B is imported only by this module: ``pip install
'nand-torch[wandb]'``.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    import wandb  # (absolute: the real package, not this module)
except ImportError as exc:  # pragma: no cover - the integration is optional
    raise ImportError(
        f"nand.integrations.wandb needs W&B: pip install 'nand-torch[wandb]' ({exc})"
    ) from exc

from nand.integrations.tracking import Report, TrackerState, is_incident, kind, text, title

log = logging.getLogger("nand")

__all__ = ["WandbBridge", "to_wandb"]


class WandbBridge:
    """An ``on_event`` callable that writes to a W&B run; see the module."""

    def __init__(self, run: Any = None, *, step_metric: str | None = None, offset: int = 0) -> None:
        self.run = run
        self.step_metric = step_metric
        self.offset = offset
        self.state = TrackerState()
        self._told_no_run = False

    def __call__(self, report: Report) -> None:
        run = self.run if self.run is not None else wandb.run
        if run is None:
            self._no_run()
            return
        level = "ERROR" if is_incident(report) else "WARN"  # (run.alert takes the names)
        run.alert(title=title(report), text=text(report), level=level)
        fields = self.state.summary(report)
        if fields is not None:
            run.summary.update(fields)
        row: dict[str, Any] = {f"nand/{kind(report)}": 1}
        if self.step_metric:  # the charts' x axis: a row of its own, at its step
            row[self.step_metric] = report.step + self.offset
        run.log(row, commit=bool(self.step_metric))

    def _no_run(self) -> None:
        if not self._told_no_run:
            self._told_no_run = True
            log.warning("nand: to_wandb: no W&B run (call wandb.init first); not writing to W&B")


def to_wandb(run: Any = None, *, step_metric: str | None = None, offset: int = 0) -> WandbBridge:
    """The ``on_event`` callable for W&B: ``run``, else the active ``wandb.run``."""
    return WandbBridge(run, step_metric=step_metric, offset=offset)
