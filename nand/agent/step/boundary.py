"""The step boundary: the one host read per optimizer step, and what follows.

Called from the optimizer pre-hook (before the update is applied), from the
GradScaler wrapper on an overflow-skipped step, from the root pre-hook when
there is no optimizer, and from ``close``. Everything here runs at most once
per step; only :meth:`Boundary.check` touches device values, in one
``tolist()`` of one gathered tensor (a slice of the probe buffer's slab, or
a stack when the window spilled, see ``probes.ProbeBuffer``). A window
that read non-finite takes the slow path of ``locate.py`` to find where.

Deferred (``read="deferred"``, the default on CUDA under ``warn``; see
``deferred.py``) the gathered tensor is copied without blocking and the
previous boundary's copy is read and analysed instead: the same
:meth:`Boundary._analyse`, from the :class:`~nand.agent.step.window.Window`
kept of that window, one step late.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

from nand.agent.detect.amp import AmpWatch, amp_figures
from nand.agent.detect.compiled import CompiledSlots
from nand.agent.detect.ddp import LocalGradCheck, grads_are_reduced, install, params_are_gathered
from nand.agent.detect.probes import MICRO, ProbeBuffer
from nand.agent.detect.tensor_parallel import TensorParallelCheck
from nand.agent.identity import Identity
from nand.agent.step import losses
from nand.agent.step.agreement import settle, settle_shards, with_agreed_flag
from nand.agent.step.analysis import ParamSource, StepRow
from nand.agent.step.blowup import BlowUpWatch, global_norm
from nand.agent.step.deferred import DeferredRead
from nand.agent.step.fingerprint import Fingerprints
from nand.agent.step.locate import extra, locate
from nand.agent.step.losses import StepLosses, losses_bad
from nand.agent.step.recorder import FlightRecorder
from nand.agent.step.report import build_event
from nand.agent.step.window import HEALTHY, SCALED_PHASES, Outcome, Window
from nand.events import Alert, Event

log = logging.getLogger("nand")


class Boundary:
    """Reads a window of probe results and turns it into telemetry and events."""

    def __init__(
        self,
        buf: ProbeBuffer,
        *,
        who: Identity,
        recorder: FlightRecorder,
        root_type: str,
        agree: bool,
        slots: CompiledSlots | None = None,
        params: ParamSource | None = None,
        fingerprints: Fingerprints | None = None,
        deferred: bool = False,
        skip_on_device: bool = False,
    ) -> None:
        self.buf = buf
        self.who = who
        self.recorder = recorder
        self.n_modules = len(recorder.modules)
        self.root_type = root_type
        self.agree = agree  # all-reduce the flag (agrees_across_ranks, torch.distributed up)
        self.amp: AmpWatch | None = None  # (adopted when a GradScaler steps the optimizer)
        self.slots = slots  # probes taken under torch.compile (see compiled.py)
        self.ddp: LocalGradCheck | None = None  # DDP: this rank's grads before the all-reduce
        self.tp: TensorParallelCheck | None = None  # TP: this rank's parts before each reduction
        self.grads_reduced = False  # a wrapper (DDP, FSDP) averages gradients across ranks
        self.params_gathered = False  # FSDP: a shard's NaN reaches every rank's forward
        self.losses = StepLosses(buf)  # Watch.loss's and the backward's (see losses.py)
        self.seq = 0
        self.blowup = BlowUpWatch(who.rank)  # early warnings (see blowup.py)
        self.reads = 0  # host reads done, for tests and the benchmark
        #: What the last window read held: its figures (None: nothing read)
        #: and its micro-steps (root forward calls).
        self.row: StepRow | None = None
        self.micro_steps = 0
        #: The last window read had nothing non-finite, suspects included
        #: (the optimizer hooks build on it, see ``optimizer.state_follows``).
        self.clean = False
        #: The norms of the last window read, and where gradients and parameters sat.
        self.read_norms: list[float] = []
        self.read_spans: dict[str, tuple[int, int]] = {}
        self.params = params  # slow path: a forward finding explained by a non-finite param
        #: Deferred read (``read="deferred"``): each window is read one boundary late.
        self.deferred: DeferredRead[tuple[Window, list[str], bool]] | None = None
        #: Deferred ``skip``: the window's non-finite flag, on the device (see ``_put``).
        self.skip_on_device = False
        self.flag: Tensor | None = None
        self.read_step = 0  # of the window read last (deferred: the one before check's)
        self.fingerprints = fingerprints  # DDP replicas', taken every N steps (fingerprint.py)
        if deferred:  # (read_mode in deferred.py)
            self.defer(skip_on_device)

    def wrapped_in(self, wrapper: Any, local_check: bool) -> None:
        """The watched model runs inside ``wrapper`` (DDP, FSDP): its gradients
        are averaged across ranks, and DDP's own can be checked first."""
        self.grads_reduced = grads_are_reduced(wrapper)
        if params_are_gathered(wrapper) and self.who.world_size > 1:
            # The ranks agree at every boundary (one 1-element all-reduce), so
            # a rank that finds another's shard behind its NaN says "received".
            self.params_gathered = self.agree = True
        if self.ddp is None:
            self.ddp = install(wrapper, local_check)

    def defer(self, skip_on_device: bool) -> None:
        """Read each window at the next boundary (``read="deferred"``); with
        ``skip_on_device`` hand the optimizer each window's flag (see ``_put``)."""
        self.deferred = DeferredRead()
        self.skip_on_device = skip_on_device
        self.buf.exact_norms = True  # read late, a norm has no tensor left to verify: exact

    def check(
        self,
        step: int,
        prev_step: int,
        prev_micro: int,
        skipped: bool,
        record: bool = True,
        micro_base: int = 0,
        decides: bool = True,
    ) -> Outcome:
        """Read the window and analyse it; the buffer is cleared afterwards.

        ``record``: keep the step's figures in the flight recorder (not for the
        last look at ``close``, which holds parameters only). ``micro_base``:
        the first micro-step of this window within ``step`` (a closure
        evaluated again in the same step). Deferred (``self.deferred``): this
        window is copied to the host and the one before it is read instead.
        ``decides``: a policy acts on this read; only then do the ranks agree
        on it (not the last look at ``close``, nor a window that filled up
        mid-step: a rank that exited early must not hang the others).
        """
        self.clean = False
        self.read_norms, self.read_spans = [], {}  # (an empty window reads none)
        self.row = None
        try:
            extras = self._extras()
            if self.slots is not None and self.slots.active:
                self._take_slots()
            self.micro_steps = self.buf.sites.count(MICRO)
            agree = self.agree and decides
            if self.deferred is not None:
                window = self._window(step, prev_step, prev_micro, skipped, record, micro_base)
                self._put(window, extras, agree)
                return self.take(keep=1)
            values, any_bad = self._read_agreed(extras) if agree else self._read()
            if values is None:
                return self._nothing_here(any_bad)
            window = self._window(step, prev_step, prev_micro, skipped, record, micro_base)
            return self._analyse(values, any_bad, extras, window)
        finally:
            self.buf.clear()
            self.losses.take()  # (taken into the window when one was read)
            # After the step's read: send the last fingerprint, take this one's.
            reduced = self.grads_reduced
            self._fingerprint(lambda f: f.at_boundary(step, reduced) if decides else f.flush())

    def flush_fingerprints(self, last_step: int | None = None) -> None:
        """At close: send a fingerprint taken and not sent yet (also when the
        close had nothing left to read), first taking one at ``last_step``."""
        self._fingerprint(lambda f: f.at_end(last_step, self.grads_reduced))

    def _fingerprint(self, action: Callable[[Fingerprints], None]) -> None:
        """Its failure turns fingerprints off, not the watch."""
        try:
            if self.fingerprints is not None:
                action(self.fingerprints)
        except Exception as exc:
            log.warning("nand: replica fingerprints off: %s", exc)
            self.fingerprints = None

    def _window(
        self,
        step: int,
        prev_step: int,
        prev_micro: int,
        skipped: bool,
        record: bool,
        micro_base: int,
    ) -> Window:
        """What the analysis needs of the buffer, kept apart from it (the
        buffer is cleared and refilled before a deferred window is read)."""
        buf = self.buf
        n_pairs = len(buf.pairs) + (len(buf.slotted) if buf.slotted is not None else 0)
        spans, buf.spans = buf.spans, {}  # handed over, not copied: the hooks fill a fresh one
        scaled = self.amp is not None and self.amp.grads_scaled()
        return Window(
            step=step,
            prev_step=prev_step,
            prev_micro=prev_micro,
            skipped=skipped,
            record=record,
            micro_base=micro_base,
            sites=buf.sites[:],
            norm_sites=buf.norm_sites[:],
            n_pairs=n_pairs,
            n_norms=len(buf.norms),
            spans=spans,
            pipeline=buf.pipeline,
            compiled=buf.slotted is not None,
            grads_scaled=scaled,
            lagged=self.deferred is not None,
            partials=self.tp.take(self.micro_steps, micro_base) if self.tp is not None else [],
            losses=self.losses.take(),
            micro_steps=self.micro_steps,
        )

    def _analyse(self, values: list[float], any_bad: bool, extras: list[str], w: Window) -> Outcome:
        """Telemetry, then the slow path when something was non-finite."""
        self.read_step = w.step
        scale, norm_scale, overflow = amp_figures(
            self.amp, values, extras, w.skipped, w.grads_scaled
        )
        loss = values[-1] if "loss" in extras else None
        row = StepRow(
            step=w.step,
            values=values,
            sites=w.sites,
            norm_sites=w.norm_sites,
            scale=scale,
            norm_scale=norm_scale,
            loss=loss,
        )
        self._keep(row, w)
        if "ddp_local" in extras and w.record:  # (DDP buckets hold the AMP-scaled gradients)
            self.recorder.local_norm(w.step, extra(values, extras, "ddp_local") / scale)
        n_main = len(values) - len(extras)
        # A float64 sum overflows only for float64 figures near their
        # limit: then the slow path finds nothing, a false alarm.
        loss_bad = losses_bad(values, extras, overflow)  # (0/0: every gradient may be 0)
        self.clean = math.isfinite(sum(values[:n_main])) and not loss_bad
        settle = not self.clean or any_bad  # (most steps: nothing to settle)
        event = self._settled_event(values, extras, scale, w, any_bad) if settle else None
        if overflow and event is not None and (event.phase not in SCALED_PHASES or loss_bad):
            # The scaler skipped the update, but what went non-finite was not
            # a scaled gradient (a bad input, forward, weight or the loss): an incident.
            overflow = False
        alerts = self._alerts(row, w) if not overflow else ()
        if event is None and not any_bad and not overflow and not alerts:
            return HEALTHY
        return Outcome(event=event, any_rank_bad=any_bad, overflow=overflow, alerts=alerts)

    def _alerts(self, row: StepRow, w: Window) -> tuple[Alert, ...]:
        grad_norm = global_norm(self.read_norms, self.read_spans.get("grad"), row.norm_scale)
        return tuple(self.blowup.look(row, w.n_pairs, grad_norm, self.clean))

    def _read(self) -> tuple[list[float] | None, bool]:
        """THE host read of the step: one gathered tensor, one ``tolist()``."""
        gathered = self.buf.gather()
        if gathered is None:
            return None, False
        self.reads += 1
        return gathered.tolist(), False

    def _keep(self, row: StepRow, w: Window) -> None:
        """Keep the row (flight recorder, the optimizer hooks' norms)."""
        if w.record:
            self.recorder.rows.append(row)
        self.row = row
        n_pairs = w.n_pairs
        self.read_norms = row.values[n_pairs : n_pairs + w.n_norms]
        self.read_spans = w.spans

    def _settled_event(
        self, values: list[float], extras: list[str], scale: float, w: Window, any_bad: bool
    ) -> Event | None:
        """The slow path's event, if this window held a non-finite value;
        with FSDP, settled with the other ranks (see ``agreement``)."""
        finding, error = None, None
        try:
            if not self.clean:  # the slow path (see locate.py)
                finding = locate(
                    w,
                    values,
                    extras,
                    params=self.params,
                    root_type=self.root_type,
                    grads_reduced=self.grads_reduced,
                )
        except Exception as exc:  # the others wait in the agreement below: take part first
            error = exc
        gathered = self.params_gathered and any_bad  # (every rank takes part: agreement.py)
        finding = settle(finding, self.params, w.prev_micro, self.buf.device, gathered)
        if error is not None:
            raise error
        if finding is None:
            return None
        at = w.prev_step if finding.phase in ("param", "optimizer_state") else w.step
        self.seq += 1
        return build_event(finding, self.who, at, self.seq, scale, self.root_type)

    def _nothing_here(self, any_bad: bool) -> Outcome:
        """An empty window: healthy, unless another rank's was not."""
        if not any_bad:
            return HEALTHY
        if self.params_gathered:  # the others settle where their NaN came from
            settle_shards(None, self.params, 0, self.buf.device)
        return Outcome(any_rank_bad=any_bad)

    def _take_slots(self) -> None:
        """The compiled slots' pairs join this window, after its own probes."""
        assert self.slots is not None
        sites, values = self.slots.take()
        self.buf.sites.extend(sites)
        self.buf.slotted = values

    def _extras(self) -> list[str]:
        names = []
        if self.amp is not None:
            amp = self.amp.extras()
            if amp:
                self.buf.extras.extend(amp)
                names += ["scale", "found_inf"]
        local = self.ddp.take() if self.ddp is not None else None
        if local is not None:
            self.buf.extras.append(local)
            names.append("ddp_local")
        kept, loss_names = self.losses.extras()  # ("loss" last: read as values[-1])
        self.buf.extras.extend(kept)
        return names + loss_names

    def _read_agreed(self, extras: list[str]) -> tuple[list[float] | None, bool]:
        """The host read when every rank must take the same decision: the 0-d
        "anything non-finite here" flag is all-reduced (MAX) first, and rides
        along in the same read."""
        gathered, device = self.buf.gather(), self.buf.device
        values = with_agreed_flag(gathered, len(extras), device, losses.count(extras)).tolist()
        self.reads += 1
        return (values[:-1] or None), values[-1] > 0

    # --- deferred: this window copied now, read at the next boundary ----------

    def _put(self, w: Window, extras: list[str], agree: bool) -> None:
        """Copy this window's results towards the host; no read, no sync. With
        ``skip_on_device`` the window's "anything non-finite" flag stays on the
        device, in ``self.flag``, for the optimizer to skip its update by."""
        assert self.deferred is not None
        gathered = self.buf.gather()
        n_extras = len(extras)
        if agree:  # the flag all-reduced on the device, last in the copy
            gathered = with_agreed_flag(gathered, n_extras, self.buf.device, losses.count(extras))
            self.flag = gathered[-1].reshape(()).float() if self.skip_on_device else None
        elif self.skip_on_device and gathered is not None:
            self.flag = losses.nonfinite_flag(gathered, n_extras, losses.count(extras))
        else:
            self.flag = None
        self.deferred.put(gathered, (w, extras, agree))

    def take(self, keep: int = 0) -> Outcome:
        """Read and analyse the oldest window copied (deferred), unless no more
        than ``keep`` are pending (the one just copied stays, for next time)."""
        assert self.deferred is not None
        taken = self.deferred.take() if len(self.deferred) > keep else None
        if taken is None:
            return HEALTHY
        self.reads += 1
        read, (w, extras, agreed) = taken
        values, any_bad = read, False
        self.read_step = w.step
        if agreed and read is not None:
            values, any_bad = read[:-1] or None, read[-1] > 0
        if values is None:
            return self._nothing_here(any_bad)
        return self._analyse(values, any_bad, extras, w)
