"""The loss of a step, in the step's one read: a non-finite loss is an incident.

A loss reaches nand two ways, and both are checked, whatever the gradients:

- handed to ``Watch.loss`` (:attr:`StepLosses.given`): the telemetry's loss too;
- every loss a backward starts from (:meth:`StepLosses.backward_from`, called
  by ``Tensor.backward`` while a watch is open: ``patches.listen_to_backward``),
  which is how a framework's loss (Lightning's ``training_step``, the HF
  ``Trainer``'s ``compute_loss``, accelerate's loop) is seen without a call of
  the user's.

Nothing is read or synchronised here: the losses (references, 0-d) join the
step's gathered tensor as extras (``"backward_loss"`` each, then ``"loss"``
last, as the telemetry reads it), and the boundary, which sums its main values
to tell a healthy step, also looks at these (:func:`losses_finite`). A
mean-reduced cross-entropy whose labels are all ignored is 0/0 = NaN with every
gradient exactly 0: only its value tells. Only then, in the slow path, are the
tensors looked at, to name the micro-step (:func:`loss_finding`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from nand.agent.detect.probes import Site
from nand.agent.step.finding import Finding
from nand.events import PHASE_RANK

#: The extras that are losses: a non-finite one makes the step non-finite.
LOSS_EXTRAS = ("backward_loss", "loss")
#: Losses kept per window at most; later ones are folded into the last (max|x|).
MAX_LOSSES = 16


class StepLosses:
    """The losses of the current window (``live``: whether the watched model
    ran in it, so that another model's backward is not taken for this one's)."""

    def __init__(self, live: object) -> None:
        self.given: Tensor | None = None
        self.started: list[Tensor] = []
        #: The window's probe entries when each backward started (``started``'s):
        #: what came before one was seen before its loss was made (see loss_finding).
        self.marks: list[int] = []
        #: The loss recorder (``rerun/recorder.py``): stopped when the window is taken.
        self.recorder: Any = None
        self._live = live  # the probe buffer: a window with sites is live

    def backward_from(self, loss: Tensor) -> None:
        """``loss.backward()`` is about to run: keep the loss (no device work
        unless more than :data:`MAX_LOSSES` backwards run in one window)."""
        if loss.numel() != 1 or not loss.is_floating_point() or not self._live.sites:  # type: ignore[attr-defined]
            return
        started = self.started
        if len(started) < MAX_LOSSES:
            started.append(loss)
            self.marks.append(len(self._live.sites))  # type: ignore[attr-defined]
        else:  # (NaN propagates through maximum: still non-finite exactly when one is)
            started[-1] = torch.maximum(_value(started[-1]).abs(), _value(loss).abs())

    def extras(self) -> tuple[list[Tensor], list[str]]:
        """The window's loss values (0-d, detached) and their extras' names,
        ``"loss"`` (the value handed to ``Watch.loss``) last."""
        given = self.given
        values = []
        for t in self.started:  # (a loop, not a comprehension: no frame of its own)
            if t is not given:  # (0-d mostly: a reshape is an op of its own)
                values.append(t.detach() if t.ndim == 0 else t.detach().reshape(()))
        names = ["backward_loss"] * len(values)
        if given is not None:
            values.append(given.detach() if given.dim() == 0 else given.detach().float().mean())
            names.append("loss")
        return values, names

    def take(self) -> tuple[list[Tensor], list[int]]:
        """The window's losses in backward order (the given one where it is
        not one of them, last) and their marks (the given one's: 0, as no
        backward started from it); the window starts afresh."""
        given, started, marks = self.given, self.started, self.marks
        recorder = self.recorder
        if recorder is not None and recorder.on:
            recorder.stop()
        if given is not None and not _among(given, started):
            started, marks = [*started, given], [*marks, 0]
        self.given, self.started, self.marks = None, [], []
        return started, marks


def nonfinite_flag(gathered: Tensor, n_extras: int, n_losses: int) -> Tensor:
    """1.0 on the device where ``gathered`` holds a non-finite value outside
    its extras, or among its last ``n_losses`` (the losses); else 0.0."""
    n = gathered.numel()
    flag = (~torch.isfinite(gathered[: n - n_extras])).any()
    if n_losses:
        flag = flag | (~torch.isfinite(gathered[n - n_losses :])).any()
    return flag.float()


def count(extras: list[str]) -> int:
    """How many of the window's extras are losses (they come last)."""
    return sum(name in LOSS_EXTRAS for name in extras)


def _model_made(first: Finding | None, micro: int) -> bool:
    """Whether ``first`` is the loss itself, made by the model: a 0-d output
    of the root module (an HF model given ``labels=`` returns its loss)."""
    return (
        first is not None
        and first.phase == "forward"
        and first.module == ""
        and first.site.kind == "output"
        and first.site.shape == ()
        and first.micro == micro
    )


def _only_the_loss(sites: list[Site | None], values: list[float]) -> bool:
    """Whether the window's only non-finite forward values are 0-d outputs of
    the root (its loss): not the logits beside it, nor a layer's output."""
    at = 0
    for site in sites:
        if site is None:
            continue
        lo, hi = values[at], values[at + 1]
        at += 2
        finite = math.isfinite(lo) and math.isfinite(hi)
        loss = not site.module and site.kind == "output" and site.shape == ()
        if site.phase in ("input", "forward") and not finite and not loss:
            return False
    return True


def _among(t: Tensor, tensors: list[Tensor]) -> bool:
    # (a loop, not any() of a generator: a frame less, on every step)
    for other in tensors:  # noqa: SIM110
        if other is t:
            return True
    return False


def _value(t: Tensor) -> Tensor:
    return t.detach().reshape(())


def losses_bad(values: list[float], extras: list[str], overflow: bool = False) -> bool:
    """Whether a loss among the window's extras (last in ``values``) is
    non-finite. In a window the GradScaler skipped (``overflow``), an infinite
    loss a backward started from is the scaled one (``scaler.scale(loss)``
    overflowing, as its gradients do): not one, unless a NaN (0/0 is NaN
    scaled or not) or the loss handed to ``Watch.loss`` says otherwise."""
    start = len(values) - len(extras)
    bad = []
    for i, name in enumerate(extras):  # (a loop: this runs every step)
        if name in LOSS_EXTRAS and not math.isfinite(values[start + i]):
            bad.append((name, values[start + i]))
    if not bad:
        return False
    if overflow:
        return any(name == "loss" or math.isnan(value) for name, value in bad)
    return bool(bad)


def loss_finding(
    first: Finding | None,
    taken: tuple[list[Tensor], list[int]],
    micro_steps: int,
    micro_base: int,
    root_type: str,
    sites: tuple[list[Site | None], list[float]] = ([], []),
) -> Finding | None:
    """The non-finite loss as the window's finding, unless ``first`` (what
    the probes found) comes before it: an input, a forward output or a
    parameter (the loss only carries those on), an earlier micro-step's, or
    a value seen before the loss's backward started (a gradient penalty's
    loss is made by a first backward: a NaN that backward made came first).
    The loss's micro-step: its backward's position among the window's (the
    last micro-step where there were fewer backwards than micro-steps)."""
    losses, marks = taken
    bad = next(
        ((i, t) for i, t in enumerate(losses) if not bool(torch.isfinite(t.detach()).all())), None
    )
    if bad is None:
        return first
    index, loss = bad
    last = max(micro_steps - 1, 0)
    micro = micro_base + (index if len(losses) == micro_steps else last)
    if _model_made(first, micro) and _only_the_loss(*sites):  # (an HF model given labels=)
        assert first is not None
        return dataclasses.replace(first, phase="loss")
    seen, reached = _seen_before(sites[0], marks[index] if index < len(marks) else 0, micro_base)
    if first is not None and (
        first.phase in ("param", "optimizer_state")
        or (first.micro, PHASE_RANK[first.phase]) < (micro, PHASE_RANK["loss"])
        or first.order < seen.get((first.micro, first.site.phase), 0)
    ):
        return first
    return _value_finding(loss, micro, reached.get(micro, 0), root_type)


def _seen_before(
    sites: list[Site | None], mark: int, micro_base: int
) -> tuple[dict[tuple[int, str], int], dict[int, int]]:
    """Of the window's probe entries before ``mark`` (a backward's start):
    how many per (micro-step, phase), as ``analysis.first_finding`` orders
    them, and per micro-step how many gradients reached the model's output
    (a backward through the model before the loss was made)."""
    seen: dict[tuple[int, str], int] = {}
    reached: dict[int, int] = {}
    micro = micro_base - 1
    for site in sites[:mark]:
        if site is None:
            micro += 1
            continue
        at = max(micro, micro_base)
        seen[at, site.phase] = seen.get((at, site.phase), 0) + 1
        if site.kind == "loss":
            reached[at] = reached.get(at, 0) + 1
    return seen, reached


def _value_finding(loss: Tensor, micro: int, call: int, root_type: str) -> Finding:
    """The loss's own finding; ``call``: the gradients that reached the
    model's output in its micro-step before its backward (a replay starts
    from the first of them: ``rerun.light.needs_probes``)."""
    site = Site(
        phase="loss",
        module="",
        module_type=root_type,
        kind="loss_value",
        dtype=loss.dtype,
        shape=tuple(loss.shape),
    )
    value = loss.detach().reshape(()).float().item()
    return Finding(
        site=site,
        phase="loss",
        module="",
        module_type=root_type,
        micro=micro,
        order=0,
        call=call,
        lo=value,
        hi=value,
        cause="produced",
        tensor=loss.detach(),
    )
