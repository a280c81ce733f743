"""The step boundary: the one host read per optimizer step, and what follows.

Called from the optimizer pre-hook (before the update is applied), from the
GradScaler wrapper on an overflow-skipped step, from the root pre-hook when
there is no optimizer, and from ``close``. Everything here runs at most once
per step; only :meth:`Boundary.read` touches device values, in one
``tolist()`` of one stacked tensor.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from nand.agent.amp import AmpWatch
from nand.agent.identity import Identity
from nand.agent.probes import ProbeBuffer
from nand.agent.recorder import FlightRecorder
from nand.agent.report import build_event
from nand.agent.step_check import StepScan, first_finding, scan
from nand.events import Event

log = logging.getLogger("nand")


@dataclasses.dataclass
class Outcome:
    """What one boundary found."""

    event: Event | None = None  # this window's first verified non-finite entry
    any_rank_bad: bool = False  # agreed across ranks (skip/stop with a process group)
    overflow: bool = False  # an AMP overflow step, skipped by the scaler
    scan: StepScan | None = None
    loss: float | None = None


class Boundary:
    """Reads a window of probe results and turns it into telemetry and events."""

    def __init__(
        self,
        buf: ProbeBuffer,
        who: Identity,
        recorder: FlightRecorder,
        n_modules: int,
        root_type: str,
        agree: bool,
    ) -> None:
        self.buf = buf
        self.who = who
        self.recorder = recorder
        self.n_modules = n_modules
        self.root_type = root_type
        self.agree = agree  # all-reduce the flag (policy skip/stop, torch.distributed up)
        self.amp: AmpWatch | None = None
        self.loss_tensor: Tensor | None = None
        self.seq = 0
        self.warned_headroom = False
        self.reads = 0  # host reads done, for tests and the benchmark

    def check(self, step: int, prev_step: int, prev_micro: int, skipped: bool) -> Outcome:
        """Read the window and analyse it; the buffer is cleared afterwards."""
        try:
            return self._check(step, prev_step, prev_micro, skipped)
        finally:
            self.buf.clear()
            self.loss_tensor = None

    def _check(self, step: int, prev_step: int, prev_micro: int, skipped: bool) -> Outcome:
        extras = self._extras()
        values, any_bad = self.read(extras)
        out = Outcome(any_rank_bad=any_bad)
        if values is None:
            return out
        scale, norm_scale, out.overflow = self._amp_figures(values, extras, skipped)
        out.loss = values[-len(extras)] if self.loss_tensor is not None else None
        out.scan = scan(self.buf, values, self.n_modules, scale, norm_scale)
        self.recorder.push(step, out.scan.act, out.scan.grad, out.scan.grad_norm, out.loss)
        self._headroom(out.scan)
        if out.scan.bad:
            finding = first_finding(self.buf, values, self.who.world_size, prev_micro)
            if finding is not None:
                at = prev_step if finding.phase in ("param", "optimizer_state") else step
                self.seq += 1
                out.event = build_event(finding, self.who, at, self.seq, scale, self.root_type)
        return out

    def _extras(self) -> list[str]:
        names = []
        if self.amp is not None:
            amp = self.amp.extras()
            if amp:
                self.buf.extras.extend(amp)
                names += ["scale", "found_inf"]
        if self.loss_tensor is not None:
            self.buf.extras.append(self.loss_tensor.detach().reshape(()))
            names.append("loss")
        return names

    def read(self, extras: list[str]) -> tuple[list[float] | None, bool]:
        """THE host read of the step: one stacked tensor, one ``tolist()``.

        With ``agree``, the 0-d "anything non-finite here" flag is all-reduced
        (MAX) first, so every rank takes the same decision; it rides along in
        the same read. A GPU version would copy ``gathered`` non-blocking into
        pinned memory and read it one step late (not implemented: no GPU here).
        """
        gathered = self.buf.gather()
        if gathered is None and not self.agree:
            return None, False
        if self.agree:
            gathered = self._agreed(gathered, len(extras))
        assert gathered is not None
        values = gathered.tolist()
        self.reads += 1
        if self.agree:
            return (values[:-1] or None), values[-1] > 0
        return values, False

    def _agreed(self, gathered: Tensor | None, n_extras: int) -> Tensor:
        import torch.distributed as dist

        if gathered is None:
            flag = torch.zeros(1)
            gathered = torch.zeros(0)
        else:
            main = gathered[: gathered.numel() - n_extras]
            flag = (~torch.isfinite(main)).any().float().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return torch.cat([gathered, flag.to(gathered.device)])

    def _amp_figures(
        self, values: list[float], extras: list[str], skipped: bool
    ) -> tuple[float, float, bool]:
        if self.amp is None or "scale" not in extras:
            return 1.0, 1.0, False
        at = len(values) - len(extras)
        scale, found_inf = values[at], values[at + 1]
        overflow = skipped or found_inf > 0
        self.amp.record(scale, overflow)
        norm_scale = scale if self.amp.grads_scaled() else 1.0
        return (scale if scale > 0 else 1.0), (norm_scale if norm_scale > 0 else 1.0), overflow

    def _headroom(self, result: StepScan) -> None:
        if result.headroom is None or self.warned_headroom:
            return
        self.warned_headroom = True
        site = result.headroom
        limit = torch.finfo(site.dtype).max if site.dtype is not None else math.inf
        log.warning(
            "nand: overflow headroom: %s (%s) reached max |x| %.4g, %.0f%% of the %s limit %.4g; "
            "it is still finite, but close to overflowing",
            site.module or "<root>",
            site.module_type,
            result.headroom_value,
            100 * result.headroom_value / limit,
            str(site.dtype).removeprefix("torch."),
            limit,
        )


Callback = Callable[[], None]
