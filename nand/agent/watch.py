"""``nand.watch``: find where a training run first went non-finite.

>>> import torch, nand
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with nand.watch(model, opt, on_nonfinite="warn") as watch:
...     for _ in range(3):
...         model(torch.randn(2, 4)).pow(2).mean().backward()
...         opt.step()
...         opt.zero_grad()
>>> watch.step, watch.first
(3, None)

What is checked, each with step, micro-step, phase and module (see
``nand.events``): the root's **input** data; every module's **forward** output
(any structure; a value made inline in a parent's forward is blamed on the
parent); the **loss** gradient arriving at the model output; every module's
**backward** (tensor hooks on forward outputs: works with in-place ops and
catches NaNs made only in backward); parameter **grad** before the optimizer
step; **param** and **optimizer_state** after it.

Arguments (each defaults to its ``NAND_*`` variable, see ``nand.config``):

- ``on_nonfinite``: ``"warn"`` logs one line per incident and goes on;
  ``"raise"`` raises :class:`nand.NonFiniteError` (``.event``) out of
  ``optimizer.step()`` before the update is applied, so the weights stay
  finite; ``"skip"`` drops that optimizer step (grads set to ``None``) and
  training goes on; ``"stop"`` is ``raise`` agreed by all ranks (one tiny
  all-reduce of a 0-d flag per step when ``torch.distributed`` is initialised;
  ranks that were fine raise :class:`nand.StopRequested`).
- ``scaler``: the ``torch.amp.GradScaler`` in use. Overflow steps it skips are
  counted (``watch.amp_skipped``), not reported; a warning comes only when the
  scale keeps collapsing. Gradient figures are reported unscaled.
- ``allow_nonfinite``: module names (globs) or type names allowed to emit
  ``-inf`` on purpose (attention masks); NaN and +inf are still caught there.
- ``server`` / ``run`` / ``events_file`` / ``flight_steps`` / ``max_events``.

Attributes: ``first`` (the first :class:`nand.Event` on this rank), ``events``
(incidents, bounded, the first always kept), ``step``, ``nonfinite_steps``,
``amp_skipped``, ``host_reads``; ``loss(t)`` records the loss for telemetry
without a sync; ``flight_window()`` returns the flight recorder's window;
``close()`` removes every hook, also on leaving the ``with`` block.

One incident, one log line (``nand`` logger, WARNING), e.g.::

    nand: rank 0: NaN in forward of attn (Attention) at step 40 [16x10x32 float32];
    it was produced here from finite inputs; made by code inline in the forward of attn

Steps that stay non-finite afterwards are counted, not logged, until a finite
step ends the incident.

Cost: every probed value gets one ``aminmax`` (detection and max|x| in one
pass), kept on the device. A Linear's, convolution's or norm's output
gradient is not hooked per call: a hook registered once on its bias probes
the bias's gradient (the output gradient summed over the batch) as it
arrives, so its gradient figure is the bias gradient's max|x| (real
probes under DDP/FSDP, ``torch.compile``, and for a second call in a
micro-step). Gradients get one ``_foreach_norm`` before the optimizer step;
parameters and optimizer state one right after it (post-hook, while still in
cache; under 1 MB they ride in the next step's gradient launch instead),
each only when not implied finite: the state of ``SGD``/``Adam``/``AdamW``
by finite gradients (``optimizer.state_follows``), their parameters (SGD
without momentum) by a host-side bound on what one update can move
(``optimizer.update_bound``). The host reads everything once per optimizer
step (one ``tolist`` of the probe buffer's slab, see ``probes.ProbeBuffer``).
Modules that cannot make a finite value non-finite (ReLU, GELU, Dropout,
Softmax, ...) are not probed in forward (their neighbours are), nor is an
inline relu/gelu/silu/tanh/sigmoid of the last probed output; in an exact
``nn.Sequential`` one that feeds a probed layer has no hook at all (an MLP has
one hook per Linear). ReLU-like ones keep a gradient probe (their backward can
hide a NaN the next module made) unless what consumes them has a benign
backward (Linear, convolutions, norms). Param and optimizer-state results are
read with the next step's boundary (or at ``close``), so a non-finite *update*
from finite gradients is reported with its step but found one step later, and
``raise`` cannot prevent that one. Measured on CPU, 1 thread (``python
benchmarks/overhead.py``): 1.29-1.32x on an MLP 64-256-256-10 SGD step (target
1.3x, on the line: torch ops' dispatch and Python that runs once a step),
1.03-1.06x on a 4-layer TransformerEncoder AdamW step (target 1.05x); see
``benchmarks/README.md``.

Limits: ``torch.compile`` — call ``nand.watch`` *before* compiling or before
the first compiled call; hooks added later are ignored by dynamo. Tensor hooks
make graph breaks, so compiled models run in several graphs (checks intact,
some speed lost; tested with ``backend="aot_eager"``). Only positional inputs
of submodules are compared for the inline-code check, and a value changed
in place by inline code is not told from the child's output. Backward blame
follows the order gradients arrive in: it names the module whose gradient
fired just before the first non-finite one; with branches (residuals) that is
a good guess, not a proof. A NaN gradient that a following Dropout zeroes
everywhere is harmless and may go unreported. On a GPU the one read per step
is a sync; reading one step late through a non-blocking copy into pinned
memory, and ``found_inf`` for a free "skip" with fused optimizers, are
designed for (see ``boundary.py``, ``optimizer.py``) but not implemented.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nand import config
from nand.agent.detect import amp, ddp
from nand.agent.detect.amp import AmpWatch
from nand.agent.detect.compiled import CompiledSlots
from nand.agent.detect.hooks import Hooks
from nand.agent.detect.modules import module_table
from nand.agent.detect.names import param_names, unwrap, unwrap_optimizer
from nand.agent.detect.optimizer import OptimizerHooks
from nand.agent.detect.probes import ProbeBuffer
from nand.agent.detect.state import HookState
from nand.agent.output.session import Session
from nand.agent.safety import Guard
from nand.agent.step.boundary import HEALTHY, Boundary, Outcome
from nand.agent.step.recorder import FlightRecorder
from nand.errors import ConfigError, NandError, NonFiniteError, StopRequested
from nand.events import Event, FlightWindow, StepSummary

__all__ = ["Watch", "watch"]

log = logging.getLogger("nand")

POLICIES = ("warn", "raise", "skip", "stop")


class Watch:
    """A watched model (and optimizer); use :func:`watch` to make one.

    ``first`` is the first :class:`nand.Event` on this rank, ``events`` the
    incidents recorded (bounded, the first always kept), ``step`` the optimizer
    steps completed (root forward calls without an optimizer).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        on_nonfinite: str,
        session: Session,
        allow_nonfinite: tuple[str, ...],
        flight_steps: int,
        max_events: int,
        scaler: Any,
        on_stop: Callable[[], None] | None = None,
        enabled: bool = True,
    ) -> None:
        """``enabled=False`` (``NAND_DISABLE=1``): an inert watch, nothing
        installed on the model, the optimizer, DDP or the scaler."""
        if on_nonfinite not in POLICIES:
            raise ConfigError(f"on_nonfinite={on_nonfinite!r}: use one of {', '.join(POLICIES)}")
        self.policy = on_nonfinite
        #: Stops the framework's loop cleanly instead of raising (integrations).
        self._on_stop = on_stop
        self._stopping = False
        self.session = session
        self.step = 0
        self.nonfinite_steps = 0
        self.first: Event | None = None
        self._events: deque[Event] = deque(maxlen=max(1, max_events - 1))
        self._in_incident = False
        self._closed = False
        self._micro = 0  # micro-steps of the window read last (for param labels)
        self._guard = Guard()
        self._buf = ProbeBuffer()
        self._root, wrapped = unwrap(model)
        self._infos = module_table(self._root, wrapped, allow_nonfinite)
        names = [info.name for info in self._infos.values()]
        self.recorder = FlightRecorder(flight_steps, names)
        self._slots = _compiled_slots(self._root)
        state = HookState(self._buf, self._guard, self._slots)
        state.window_full = self._window_full
        self._hooks = Hooks(state)
        world = session.who.world_size
        agree = on_nonfinite in ("skip", "stop") and _dist_up() and world > 1
        root_type = type(self._root).__name__
        self._boundary = Boundary(
            self._buf, session.who, self.recorder, len(names), root_type, agree
        )
        self._boundary.slots = self._slots
        self._opt: OptimizerHooks | None = None
        self._amp: AmpWatch | None = None
        self._unlisten: Callable[[], None] | None = None
        self._looking: RemovableHandle | None = None
        if not enabled:
            self._closed = True  # nothing to remove, nobody to tell
            self._guard.off = True  # new_batch, loss(): nothing recorded
            return
        self._install(model, optimizer, scaler, wrapped)
        self._set_dtype()
        self._hello(optimizer, on_nonfinite)

    def _install(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler: Any, wrapped: bool
    ) -> None:
        """Hook the model, the optimizer, the scaler and the DDP wrapper."""
        grads_reduced = ddp.grads_are_reduced(model)
        self._hooks.install(self._root, self._infos, proxies=not grads_reduced)
        self._boundary.grads_reduced = grads_reduced
        if optimizer is None:
            self._hooks.state.before_root = self._root_step
        else:
            self._opt = self._hook_optimizer(optimizer, wrapped)
            self._boundary.params = self._opt
            if scaler is not None:
                self._adopt_scaler(scaler)
            # Frameworks make their own scaler: learn it when it steps this optimizer.
            self._unlisten = amp.listen(optimizer, self._adopt_scaler)
        self._boundary.ddp = _install_ddp_check(model)
        # A plain model trained through a wrapper nand was not given (HF Trainer's
        # callbacks get the model, accelerate wraps it in DDP): found at its first call.
        if not wrapped and _dist_up() and self.session.who.world_size > 1:
            self._looking = ddp.find_wrapper(self._root, self._found_wrapper)

    # --- public API ------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        """Incidents on this rank, oldest first; the first one is always kept."""
        rest = [e for e in self._events if e is not self.first]
        return ([self.first] if self.first is not None else []) + rest

    @property
    def amp_skipped(self) -> int:
        """Overflow steps the GradScaler skipped (not incidents)."""
        return self._amp.skipped if self._amp is not None else 0

    @property
    def host_reads(self) -> int:
        """Host reads nand did so far (one per optimizer step at most)."""
        return self._boundary.reads

    def loss(self, loss: Tensor) -> Tensor:
        """Record the loss of this step for telemetry, without a sync; returns it."""
        self._boundary.loss_tensor = loss
        return loss

    def new_batch(self, batch: Any) -> None:
        """Start a micro-step with ``batch``, checked as the input data.

        For loops in which the watched model's ``forward`` is not what takes
        the batch (Lightning's ``training_step``, which may call a submodule):
        from the first call on, micro-steps are counted here, not at root calls.
        """
        self._hooks.new_batch(self._infos[self._root], batch)

    def flight_window(self) -> FlightWindow:
        """The flight recorder: per-module telemetry of the last steps."""
        return self.recorder.window()

    def close(self, reason: str = "closed") -> None:
        """Remove every hook, read what is left, say goodbye. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._guard.off and self._opt is not None and self._opt.stepped_once:
                # The last step's params (even if implied finite) and state.
                self._opt.add_norms(with_params=True, force=True)
            if not self._guard.off and len(self._buf):
                outcome = self._boundary.check(self.step, self.step - 1, self._micro, False, False)
                self._report(outcome, beat=False)
                if self._opt is None and self._boundary.micro_steps:
                    self.step += 1  # without an optimizer, the last root call is a step
        except Exception as exc:
            self._guard.failed(exc, "close")
        finally:
            self._hooks.remove()
            if self._boundary.ddp is not None:
                self._boundary.ddp.close()
            if self._opt is not None:
                self._opt.remove()
            if self._amp is not None:
                self._amp.close()
            if self._unlisten is not None:
                self._unlisten()
            if self._looking is not None:
                self._looking.remove()
            self._buf.clear()
            self.session.close(self.step, reason)

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        reason = "closed" if exc is None else f"exception: {type(exc).__name__}"
        self.close(reason)

    # --- step boundaries --------------------------------------------------------

    def _on_step(self) -> None:
        """Optimizer pre-hook: read the window; apply the policy before the
        update; count the update that goes ahead (here, not in a post-hook:
        one hook call less per step, and an optimizer that raises mid-update
        is counted all the same). :meth:`_guarded_check`, :meth:`_report` and
        :meth:`_serve_session` are written out for a healthy step (see
        ``OptimizerHooks._pre`` on what a call costs here)."""
        outcome = None
        if self._looking is not None:  # the first step: a wrapper would have been called
            self._looking.remove()
            self._looking = None
        if not self._guard.off:
            try:
                boundary = self._boundary
                outcome = boundary.check(self.step, self.step - 1, self._micro, False)
                if outcome is HEALTHY and not self.session.per_step:
                    self._micro = boundary.micro_steps - 1 if boundary.micro_steps else 0
                    self._in_incident = False  # (what _report does with a healthy step)
                else:
                    self._report(outcome)
            except NandError:
                raise
            except Exception as exc:
                self._guard.failed(exc, "step boundary")
        if self.session.per_step or self.session.stop_at is not None:
            self._serve_session()
        if outcome is not None:
            if outcome.overflow:
                assert self._opt is not None
                self._opt.drop_grads()  # a fused optimizer got found_inf; nothing to apply
            elif outcome.event is not None or outcome.any_rank_bad:
                self._apply_policy(outcome)
        if not self._guard.off:  # switched off by its own error: nothing counted from here on
            self.step += 1

    def _on_evaluation(self, evaluation: int) -> None:
        """The closure ran again within the step just counted (LBFGS's line
        search): its forward and backward are checked now, as micro-steps of
        that step after the first evaluation's. The update of that step may
        already be partly applied: ``raise`` stops the line search, nothing more."""
        outcome = self._guarded_check(skipped=False, step=self.step - 1, micro_base=evaluation)
        if outcome is not None and outcome.event is not None and self.policy in ("raise", "stop"):
            raise NonFiniteError(outcome.event)

    def _apply_policy(self, outcome: Outcome) -> None:
        """A non-finite step (here or, agreed, on another rank): warn, skip or raise."""
        event = outcome.event
        if self.policy == "warn":
            return
        if self.policy == "skip":
            assert self._opt is not None
            self._opt.drop_grads()
            log.warning("nand: skipped optimizer step %d (non-finite)", self.step)
        elif self.policy == "raise" and event is not None:
            raise NonFiniteError(event)
        elif event is not None and event.cause != "received":
            self._stop(NonFiniteError(event))
        else:  # (stop) this rank only received it, or another rank saw it
            self._stop(StopRequested(self.step, "a non-finite value on another rank"))

    def _stop(self, error: NandError) -> None:
        """Stop training at this step boundary, before the update: raise
        ``error`` out of ``optimizer.step()``, or, with ``on_stop`` (the
        framework integrations), skip this update and ask the framework to
        end its loop (Lightning's ``trainer.should_stop``, HF's
        ``control.should_training_stop``)."""
        if self._on_stop is None:
            raise error
        if self._opt is not None:
            self._opt.drop_grads()
        if not self._stopping:
            self._stopping = True
            log.warning("nand: stopping training at step %d: %s", self.step, error)
            self._on_stop()

    def _found_wrapper(self, wrapper: nn.Module) -> None:
        """The watched model runs inside ``wrapper`` (DDP, FSDP): its gradients
        are averaged across ranks, and DDP's own can be checked first."""
        try:
            self._boundary.grads_reduced = ddp.grads_are_reduced(wrapper)
            if self._boundary.ddp is None:
                self._boundary.ddp = _install_ddp_check(wrapper)
        except Exception as exc:
            self._guard.failed(exc, "wrapper discovery")

    def _adopt_scaler(self, scaler: Any) -> None:
        """A GradScaler steps this watch's optimizer: from now on its overflow
        skips are counted, not reported, and gradient figures are unscaled."""
        if self._amp is not None and self._amp.scaler is scaler:
            return
        try:
            if self._amp is not None:
                self._amp.close()
            assert self._opt is not None
            self._amp = AmpWatch(scaler, self._opt.optimizer, self._stepped, self._amp_skipped)
            self._boundary.amp = self._amp
        except Exception as exc:
            self._guard.failed(exc, "GradScaler adoption")

    def _amp_skipped(self) -> None:
        """GradScaler.update without an optimizer step: an iteration whose
        update the scaler skipped (overflow). It counts as a step all the
        same: ``step`` is the loop's iteration, as the frameworks count it."""
        self._guarded_check(skipped=True)
        if not self._guard.off:
            self.step += 1
        if self.session.per_step or self.session.stop_at is not None:
            self._serve_session()

    def _stepped(self) -> bool:
        opt = self._opt
        stepped = opt is not None and opt.stepped
        if opt is not None:
            opt.stepped = False
        return stepped

    def _root_step(self) -> None:
        """Without an optimizer each root call is a step: called from the
        root's pre-hook (or the first child's hook that does its work)."""
        if self._buf.sites:
            outcome = self._guarded_check(skipped=False)
            self.step += 1
            self._serve_session()
            event = outcome.event if outcome is not None else None
            if event is not None and self.policy in ("raise", "stop"):
                raise NonFiniteError(event)

    def _serve_session(self) -> None:
        """After a boundary: take the server's commands, stop if it asked to."""
        session = self.session
        if session.per_step:
            session.poll(self.step, self.flight_window)
        if session.stop_at is not None and self.step >= session.stop_at:
            self._stop(StopRequested(session.stop_at, "requested by the server"))

    def _window_full(self) -> None:
        """An optimizer that never steps must not make the buffer grow forever."""
        self._guarded_check(skipped=False)

    def _guarded_check(
        self, skipped: bool, step: int | None = None, micro_base: int = 0
    ) -> Outcome | None:
        if self._guard.off:
            return None
        step = self.step if step is None else step
        try:
            outcome = self._boundary.check(
                step, step - 1, self._micro, skipped, record=not micro_base, micro_base=micro_base
            )
            self._report(outcome)
            return outcome
        except NandError:
            raise
        except Exception as exc:
            self._guard.failed(exc, "step boundary")
            return None

    def _report(self, outcome: Outcome, beat: bool = True) -> None:
        """Record, log and send an incident; one message per incident, no flood."""
        micro_steps = self._boundary.micro_steps
        self._micro = micro_steps - 1 if micro_steps else 0
        event = outcome.event
        if outcome.overflow:
            if self._amp is not None and self._amp.collapsing():
                log.warning(
                    "nand: the AMP loss scale keeps collapsing: %d overflow steps in a row, "
                    "scale %.3g%s",
                    self._amp.consecutive,
                    self._amp.scale,
                    f"; first non-finite: {outcome.event.message}" if outcome.event else "",
                )
            return
        if beat and self.session.per_step:
            self.session.step_done(self.step, self._summary)
        if event is None:
            self._in_incident = False
            return
        self.nonfinite_steps += 1
        if self._in_incident:
            return
        self._in_incident = True
        if self.first is None:
            self.first = event
        self._events.append(event)
        self.session.event(event, self.recorder.window())

    # --- setup ------------------------------------------------------------------

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer, wrapped: bool) -> OptimizerHooks:
        owners = {m: info for m, info in self._infos.items()}
        names: dict[Any, tuple[str, str]] = {}
        for module, info in owners.items():
            for pname, p in module.named_parameters(recurse=False):
                names.setdefault(p, (f"{info.name}.{pname}" if info.name else pname, info.type))
        for p, name in param_names(self._root, wrapped).items():
            names.setdefault(p, (name, ""))
        return OptimizerHooks(
            optimizer,
            self._buf,
            self._guard,
            names,
            self._on_step,
            window=self._boundary,
            evaluated=self._on_evaluation,
        )

    def _hello(self, optimizer: Any, policy: str) -> None:
        p = next(iter(self._root.parameters()), None)
        modules = [
            {
                "name": info.name,
                "type": info.type,
                "order": info.index,
                "params": sum(q.numel() for q in module.parameters(recurse=False)),
            }
            for module, info in self._infos.items()
        ]
        optimizer_type = type(optimizer).__name__ if optimizer is not None else None
        device = str(p.device) if p is not None else "cpu"
        self.session.hello(device, modules, optimizer_type, policy)

    def _summary(self, steps_per_s: float) -> StepSummary:
        """The heartbeat's figures, from what the last steps already read."""
        tele = self.recorder.last()
        rows = self.recorder.rows
        return StepSummary(
            step=self.step,
            steps_per_s=steps_per_s,
            loss=rows[-1].loss if rows else None,
            grad_norm=tele.grad_norm if tele else None,
            max_activation=tele.max_act if tele else None,
            amp_skipped=self.amp_skipped,
            amp_scale=self._amp.scale if self._amp is not None else None,
        )

    def _set_dtype(self) -> None:
        p = next((p for p in self._root.parameters() if p.is_floating_point()), None)
        if p is not None:
            self.recorder.dtype = str(p.dtype).removeprefix("torch.")
            self.recorder.dtype_max = float(torch.finfo(p.dtype).max)


def _compiled_slots(root: nn.Module) -> CompiledSlots:
    """The slots for probes under torch.compile, on the model's device, in a
    dtype that holds every parameter dtype's range (float64 models: float64)."""
    params = [p for p in root.parameters() if p.is_floating_point()]
    device = params[0].device if params else torch.device("cpu")
    wide = any(p.dtype == torch.float64 for p in params)
    return CompiledSlots(device, torch.float64 if wide else torch.float32)


def _dist_up() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def watch(
    model: nn.Module,
    optimizer: Any = None,
    *,
    on_nonfinite: str | None = None,
    server: str | None = None,
    run: str | None = None,
    events_file: str | None = None,
    allow_nonfinite: tuple[str, ...] | list[str] = (),
    flight_steps: int | None = None,
    max_events: int | None = None,
    scaler: Any = None,
    log_events: bool = True,
    on_stop: Callable[[], None] | None = None,
) -> Watch:
    """Hook nand into ``model`` (and ``optimizer``); see the module docstring."""
    if optimizer is not None:  # accelerate's, Lightning's, DeepSpeed's wrappers
        optimizer = unwrap_optimizer(optimizer)
    policy = on_nonfinite or config.get_str(config.NAND_ON_NONFINITE, "warn") or "warn"
    disabled = config.get_bool(config.NAND_DISABLE)
    session = Session.open(
        server=None if disabled else server or config.get_str(config.NAND_SERVER),
        run=run,
        events_file=None if disabled else events_file or config.get_str(config.NAND_EVENTS_FILE),
        log_events=log_events and not disabled,
    )
    w = Watch(
        model,
        optimizer,
        on_nonfinite=policy,
        session=session,
        allow_nonfinite=tuple(allow_nonfinite),
        flight_steps=flight_steps or config.get_int(config.NAND_FLIGHT_STEPS, 64),
        max_events=max_events or config.get_int(config.NAND_MAX_EVENTS, 1000),
        scaler=scaler,
        on_stop=on_stop,
        enabled=not disabled,
    )
    return w


def _install_ddp_check(model: nn.Module) -> ddp.LocalGradCheck | None:
    try:
        return ddp.install(model)
    except Exception as exc:  # DDP refused the hook: go on without the local check
        log.warning("nand: DDP local gradient check not installed (%s)", exc)
        return None
