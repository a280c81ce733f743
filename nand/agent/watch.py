"""The :class:`Watch`: wires the detectors, the step boundary and the output.

It installs the detectors of ``nand.agent.detect``: module and gradient hooks
that keep one device-side reduction per probed value, the optimizer hooks
that mark the step boundary, the GradScaler watch and DDP's pre-all-reduce
check. At each boundary ``nand.agent.step`` reads everything once and finds
the first non-finite value; the outcome comes back here, where the policy
(``step.policy``) is applied before the update. What is checked: the README.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nand.agent import patches
from nand.agent.detect import amp, ddp
from nand.agent.detect.compiled import CompiledSlots
from nand.agent.detect.hooks import Hooks
from nand.agent.detect.modules import described, module_table
from nand.agent.detect.names import unwrap
from nand.agent.detect.optimizer import OptimizerHooks
from nand.agent.detect.param_cache import ParamCache
from nand.agent.detect.probes import ProbeBuffer
from nand.agent.detect.state import HookState
from nand.agent.detect.tiers import Tiers
from nand.agent.identity import distributed_up
from nand.agent.output.session import Session
from nand.agent.readout import Readout
from nand.agent.rerun import Rerun
from nand.agent.safety import Guard
from nand.agent.step.build import build_boundary, param_cache
from nand.agent.step.deferred import flush_at_exit, read_mode
from nand.agent.step.fingerprint import ended_cleanly
from nand.agent.step.incidents import Incidents
from nand.agent.step.policy import StepPolicy
from nand.agent.step.recorder import FlightRecorder
from nand.agent.step.window import HEALTHY, Outcome
from nand.config import AgentConfig
from nand.errors import NandError, NonFiniteError, StopRequested

__all__ = ["Watch"]


class Watch(Readout):
    """A watched model (and optimizer); use :func:`watch` to make one.

    ``first`` is the first :class:`nand.Event` on this rank, ``events`` the
    incidents recorded (bounded, the first always kept), ``step`` the optimizer
    steps completed (root forward calls without an optimizer); these and the
    other read-only members are :class:`~nand.agent.readout.Readout`'s.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        settings: AgentConfig,
        session: Session,
        allow_nonfinite: tuple[str, ...] = (),
        scaler: Any = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        """With ``settings.disabled`` (``NAND_DISABLE=1``): an inert watch,
        nothing installed on the model, the optimizer, DDP or the scaler."""
        self.settings = settings
        self.session = session
        self.step = 0
        self._incidents = Incidents(settings.max_events)
        self._closed = False
        self._micro = 0  # micro-steps of the window read last (for param labels)
        self._guard = Guard()
        self._buf = ProbeBuffer()
        self._root, wrapped = unwrap(model)
        self._infos = module_table(self._root, wrapped, allow_nonfinite)
        names = [info.name for info in self._infos.values()]
        self.recorder = FlightRecorder(settings.flight_steps, names)
        self._slots = CompiledSlots.for_model(self._root, self._infos.values())
        deferred, on_device = read_mode(settings, self._root, optimizer)  # (step/deferred.py)
        self._policy = self._step_policy(on_stop, deferred, on_device)
        state = self._hook_state(stepped_by_optimizer=optimizer is not None)
        self._hooks = Hooks(state)
        self._tiers = Tiers(self._hooks, self._root, self._infos)  # (the mode: see tiers.py)
        cache = param_cache(settings, optimizer, self._root, self._infos, wrapped)
        self._boundary = build_boundary(
            settings,
            session,
            root=self._root,
            buf=self._buf,
            recorder=self.recorder,
            slots=self._slots,
            optimizer=optimizer,
            params=cache,
            read=(deferred, on_device),
        )
        self._opt: OptimizerHooks | None = None
        self._amp = None
        self._unlisten: Callable[[], None] | None = None
        self._looking: RemovableHandle | None = None
        self._rerun = Rerun(self._root, self._guard, state, self._boundary, self._tiers)
        if settings.disabled:
            self._closed = True  # nothing to remove, nobody to tell
            self._guard.off = True  # new_batch, loss(): nothing recorded
            return
        self._install(model, optimizer, cache, scaler)
        self.recorder.set_dtype_of(self._root)
        self._hello(optimizer)

    def _install(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        cache: ParamCache | None,
        scaler: Any,
    ) -> None:
        """Hook the model, the optimizer, the scaler and the DDP wrapper."""
        if self.deferred:
            flush_at_exit(self._exit)
        self._boundary.wrapped_in(model, self.settings.ddp_local_check)  # (DDP: its check)
        self._tiers.install(self.settings, model, proxies=not self._boundary.grads_reduced)
        self._boundary.tp = self._tiers.tp  # (tensor parallelism: its layers' own parts)
        if optimizer is not None and cache is not None:
            self._opt = self._hook_optimizer(optimizer, cache)
            if scaler is not None:
                self._adopt_scaler(scaler)
            # Frameworks make their own scaler: learn it when it steps this optimizer.
            self._unlisten = patches.listen_to_scalers(optimizer, self._adopt_scaler)
        # A wrapper nand was not given (HF Trainer, accelerate's DDP): found at its first call.
        if model is self._root and distributed_up() and self.session.who.world_size > 1:
            self._looking = ddp.find_wrapper(self._root, self._found_wrapper)
        self._rerun.install(self.settings.replays)  # (after nand's own root hooks: see rerun)

    def _step_policy(
        self, on_stop: Callable[[], None] | None, deferred: bool, on_device: bool
    ) -> StepPolicy:
        """The policy applied to each step's outcome; it drops the gradients
        through this watch's optimizer hooks."""
        return StepPolicy(
            self.settings.on_nonfinite,
            drop_grads=self._drop_grads,
            on_stop=on_stop,
            on_warning=self.settings.on_warning,
            lagged=deferred,
            on_device=on_device,
        )

    def _hook_state(self, stepped_by_optimizer: bool) -> HookState:
        """What the model's hooks share, with the two calls they make back
        into this watch: a full window, and (without an optimizer) each root
        call, which is a step."""
        root_step = None if stepped_by_optimizer else self._root_step
        return HookState(
            self._buf,
            self._guard,
            self._slots,
            before_root=root_step,
            window_full=self._window_full,
        )

    # --- public API ------------------------------------------------------------

    def loss(self, loss: Tensor) -> Tensor:
        """Record the loss of this step (checked, in the heartbeats), no sync; returns it."""
        self._boundary.losses.given = loss
        return loss

    def new_batch(self, batch: Any, step: Callable[[Any], Tensor] | None = None) -> None:
        """Start a micro-step with ``batch``, checked as the input data: for loops
        in which the model's ``forward`` is not what takes the batch (Lightning's
        ``training_step``); from then on micro-steps are counted here. A replay
        runs ``step(batch)``, which returns the loss its backward started from.
        """
        self._tiers.new_batch(batch, step)  # (light mode without a step: full from now on)

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
                step = self.step
                outcome = self._boundary.check(
                    step, step - 1, self._micro, False, False, decides=False
                )
                self._report(outcome, beat=False)
                if self._opt is None and self._boundary.micro_steps:
                    self.step += 1  # without an optimizer, the last root call is a step
            self._flush(self.step if ended_cleanly(reason, self._guard.off) else None)
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
            self._rerun.remove()
            self._buf.clear()
            self.session.close(self.step, reason, self._summary)

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close("closed" if exc is None else f"exception: {type(exc).__name__}")

    # --- step boundaries --------------------------------------------------------

    def _on_step(self) -> None:
        """Optimizer pre-hook: read the window; apply the policy before the
        update; count the update that goes ahead (here, not in a post-hook:
        an optimizer that raises mid-update is counted all the same)."""
        if self._looking is not None:  # the first step: a wrapper would have been called
            self._looking.remove()
            self._looking = None
        outcome = self._guarded_check(skipped=False)
        self._serve_session()
        if outcome is not None and outcome is not HEALTHY:  # (the policy: see step/policy.py)
            self._policy.act(outcome, self._boundary.read_step)
        if not self._guard.off:  # switched off by its own error: nothing counted from here on
            self.step += 1

    def _on_evaluation(self, evaluation: int) -> None:
        """The closure ran again within the step just counted (LBFGS's line
        search): its forward and backward are checked now, as micro-steps of
        that step after the first evaluation's. The update of that step may
        already be partly applied: ``raise`` stops the line search, nothing more."""
        outcome = self._guarded_check(skipped=False, step=self.step - 1, micro_base=evaluation)
        if outcome is not None and outcome.event is not None and self._policy.raises:
            raise NonFiniteError(outcome.event)

    def _exit(self) -> None:
        """Deferred, at interpreter exit with the watch open: close, so the
        windows still pending are read and written; after an unhandled
        exception only read them (no bye: the server tells a crash by that)."""
        if getattr(sys, "last_value", None) is None:
            self.close("exit")
        self._flush()

    def _flush(self, last_step: int | None = None) -> None:
        """Report what is pending (deferred windows, fingerprints; one of ``last_step``)."""
        deferred = self._boundary.deferred
        try:
            while deferred and not self._guard.off:
                self._report(self._boundary.take(), beat=False)
            self._boundary.flush_fingerprints(last_step)
        except Exception as exc:
            self._guard.failed(exc, "deferred read")

    def _drop_grads(self) -> None:
        if self._opt is not None:
            self._opt.drop_grads()

    def _found_wrapper(self, wrapper: nn.Module) -> None:
        """The watched model runs inside ``wrapper`` (DDP, FSDP): its gradients
        are averaged across ranks, and DDP's own can be checked first."""
        try:
            self._boundary.wrapped_in(wrapper, self.settings.ddp_local_check)
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
            opt = self._opt
            self._amp = amp.AmpWatch(scaler, opt.optimizer, opt.take_stepped, self._amp_skipped)
            self._boundary.amp = self._amp
        except Exception as exc:
            self._guard.failed(exc, "GradScaler adoption")

    def _amp_skipped(self) -> None:
        """GradScaler.update without an optimizer step: an iteration whose
        update the scaler skipped (overflow). It counts as a step all the
        same: ``step`` is the loop's iteration, as the frameworks count it."""
        if self._opt is not None:
            self._opt.add_skipped()
        self._guarded_check(skipped=True)
        if not self._guard.off:
            self.step += 1
        self._serve_session()

    def _root_step(self) -> None:
        """Without an optimizer each root call is a step: called from the
        root's pre-hook (or the first child's hook that does its work)."""
        if self._buf.sites:
            outcome = self._guarded_check(skipped=False)
            self.step += 1
            self._serve_session()
            event = outcome.event if outcome is not None else None
            if event is not None and self._policy.raises:
                raise NonFiniteError(event)

    def _serve_session(self) -> None:
        """After a boundary: take the server's commands, stop if it asked to."""
        session = self.session
        if session.per_step:
            session.poll(self.step, self.flight_window)
        if session.stop_at is not None and self.step >= session.stop_at:
            stop = StopRequested(session.stop_at, "requested by the server")
            self._policy.stop(stop, self.step)

    def _window_full(self) -> None:
        """An optimizer that never steps must not make the buffer grow forever."""
        self._guarded_check(skipped=False, decides=False)

    def _guarded_check(
        self, skipped: bool, step: int | None = None, micro_base: int = 0, decides: bool = True
    ) -> Outcome | None:
        if self._guard.off:
            return None
        step = self.step if step is None else step
        try:
            outcome = self._boundary.check(
                step, step - 1, self._micro, skipped, not micro_base, micro_base, decides
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
        micro_steps = self._tiers.window_read(self._boundary.micro_steps, beat)
        self._micro = micro_steps - 1 if micro_steps else 0
        event = outcome.event
        if outcome.overflow:
            if self._amp is not None:
                self._amp.warn_if_collapsing(event.message if event else None)
            return
        for alert in outcome.alerts:
            self.session.alert(alert)
        if beat and self.session.per_step:
            self.session.step_done(self.step, self._summary)
        if event is None:
            self._incidents.finite_step()
        elif self._incidents.nonfinite_step(event):
            self._rerun.explain(event, lagged=self.deferred)  # the op, the line, reproduced
            self.session.event(event, self.recorder.window())

    # --- setup ------------------------------------------------------------------

    def _hook_optimizer(
        self, optimizer: torch.optim.Optimizer, cache: ParamCache
    ) -> OptimizerHooks:
        return OptimizerHooks(
            optimizer,
            self._buf,
            self._guard,
            cache,
            self._on_step,
            window=self._boundary,
            evaluated=self._on_evaluation,
            # Deferred, no plan can wait for the window read one step late.
            read_params_every_step=self.settings.read_params_every_step or self.deferred,
        )

    def _hello(self, optimizer: Any) -> None:
        p = next(iter(self._root.parameters()), None)
        optimizer_type = type(optimizer).__name__ if optimizer is not None else None
        device = str(p.device) if p is not None else "cpu"
        policy = self.settings.on_nonfinite
        self.session.hello(device, described(self._infos), optimizer_type, policy)
