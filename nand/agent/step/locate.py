"""The slow path of a step boundary: where a window read non-finite went bad.

Most steps read finite and never come here. When one does not, the
:class:`~nand.agent.step.boundary.Boundary` hands its window and values to
:func:`locate`, which puts the findings of the detectors together: the first
verified non-finite entry (``analysis.first_finding``), a loss that went bad
first (``losses.loss_finding``), a parameter behind a forward finding
(``analysis.param_behind``), a tensor-parallel part received from another
rank and, under ``torch.compile``, the gradient frontier. Whether a
gradient was made on this rank or received through the collective is
:func:`grad_cause`'s answer. The boundary then settles the finding with the
other ranks and builds the event.
"""

from __future__ import annotations

import math

from nand.agent.detect.tensor_parallel import received_through_tp
from nand.agent.step.analysis import (
    COMPILED_NOTE,
    ParamSource,
    first_finding,
    gradient_frontier,
    param_behind,
)
from nand.agent.step.finding import Finding
from nand.agent.step.losses import loss_finding
from nand.agent.step.window import Window
from nand.events import Cause


def locate(
    w: Window,
    values: list[float],
    extras: list[str],
    *,
    params: ParamSource | None,
    root_type: str,
    grads_reduced: bool,
) -> Finding | None:
    """The window's first verified non-finite entry.

    A window read one step late (``w.lagged``) is not verified against
    its tensors, which have moved on since: see ``analysis.first_finding``.
    """
    cause = grad_cause(values, extras, grads_reduced)
    finding = first_finding(w, values, cause, w.prev_micro, w.micro_base, w.lagged)
    finding = loss_finding(
        finding, w.losses, w.micro_steps, w.micro_base, root_type, (w.sites, values)
    )
    if (
        finding is not None
        and finding.phase == "forward"
        and params is not None
        and not w.lagged  # (deferred: every window reads the parameters)
    ):
        finding = param_behind(finding, w.prev_micro, params) or finding
    if finding is None:
        return None
    received_through_tp(finding, w.partials)  # (a tensor-parallel layer's: see there)
    if w.compiled:  # probed under torch.compile (see compiled.py)
        if finding.phase == "grad" and finding.cause == "produced":
            finding = gradient_frontier(w, values, finding, verify=not w.lagged)
        finding.note = finding.note or COMPILED_NOTE
    return finding


def grad_cause(values: list[float], extras: list[str], grads_reduced: bool) -> Cause:
    """A non-finite ``.grad`` first seen here: made on this rank, or received?

    With DDP's local check the answer is measured: were this rank's own
    gradients finite before the all-reduce. Under another wrapper that
    averages gradients (FSDP, ``grads_reduced``) it arrived through the
    collective unless this rank's backward showed it first (that finding
    would have come first).
    """
    if "ddp_local" in extras:
        local = extra(values, extras, "ddp_local")
        return "received" if math.isfinite(local) else "produced"
    return "received" if grads_reduced else "produced"


def extra(values: list[float], extras: list[str], name: str) -> float:
    """The value of the extra ``name`` (``scale``, ``ddp_local``, ...), read
    after the window's own values."""
    return values[len(values) - len(extras) + extras.index(name)]
