"""Optimizer step hooks: the step boundary, and the gradient, parameter and
state checks that ride on it.

- **pre-hook** (before ``optimizer.step`` applies anything): one
  ``_foreach_norm`` over the ``.grad`` of every parameter; then the step
  boundary runs (``Watch._on_step``): the one host read, the policy. Raising
  there (``raise``/``stop``) leaves the weights untouched. Once the boundary
  lets the update go ahead, :meth:`OptimizerHooks._plan` decides from that
  read and the hyperparameters whether what the update writes must be read at
  the next boundary (:mod:`nand.agent.detect.update_rules` says what finite
  gradients imply).
- **parameters and state**, when due, get one ``_foreach_norm`` over the
  parameters and float optimizer state (``step`` counters skipped). A small
  model's ride in the next pre-hook's launch with the gradients; a large
  model's are taken by a **post-hook**, registered only then, right after the
  update wrote them, while still in cache. Either way they are read with the
  next step's boundary and labelled with this step; ``close`` reads the last
  step's.
- A parameter written non-finite by code other than the optimizer, while its
  read was skipped, is found in the next forward and reported as ``param``
  (``step.analysis.param_behind``). ``read_params_every_step`` turns the
  skipping off, to rule it out.
- **skip** drops the step by setting every ``.grad`` to ``None``: optimizers
  skip parameters without a gradient (no update, no weight decay, no step
  count). With the deferred read the host does not know yet: a fused
  optimizer (:func:`skips_on_device`) is handed the window's flag as its
  ``found_inf`` (what ``GradScaler.step`` hands it; the larger of the two when
  a scaler set one), and its kernel skips the update on the device.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from itertools import repeat
from operator import is_
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from nand.agent.detect.param_cache import GRAD, ParamCache
from nand.agent.detect.probes import ProbeBuffer, Site, local
from nand.agent.detect.update_rules import (
    GroupRules,
    bound_after_update,
    buffer_after_update,
    state_follows,
)
from nand.agent.safety import Guard


def _closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The closure passed to ``optimizer.step`` (``args[0]`` is the optimizer)."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    return closure if callable(closure) else None


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer`` skips an update on the device when its ``found_inf``
    is 1, as ``GradScaler.step`` uses it: ``fused=True`` Adam, AdamW and SGD
    (``_step_supports_amp_scaling``, without the older ``grad_scaler`` argument).
    Not SGD with momentum: its fused kernel, skipped at the first step, leaves
    the momentum buffer it allocated uninitialised (torch 2.13)."""
    from torch.optim import SGD, Adam, AdamW

    if not isinstance(optimizer, Adam | AdamW | SGD) or not all(
        group.get("fused") for group in optimizer.param_groups
    ):
        return False
    if isinstance(optimizer, SGD) and any(g.get("momentum") for g in optimizer.param_groups):
        return False
    supports = getattr(optimizer, "_step_supports_amp_scaling", False)
    return bool(supports) and "grad_scaler" not in inspect.signature(optimizer.step).parameters


class ReadWindow(Protocol):
    """What the last step boundary read (``boundary.Boundary``)."""

    #: Deferred ``skip``: this window's "non-finite" flag, on the device.
    flag: Tensor | None
    clean: bool  # nothing non-finite, suspects included
    read_norms: list[float]  # the multi-tensor norms, in launch order
    read_spans: dict[str, tuple[int, int]]  # (start, count) of "grad", "param", "state" in them


class OptimizerHooks:
    """Hooks one optimizer; ``boundary`` is called from the pre-hook."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buf: ProbeBuffer,
        guard: Guard,
        cache: ParamCache,
        boundary: Callable[[], None],
        window: ReadWindow,
        evaluated: Callable[[int], None],
        read_params_every_step: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.buf = buf
        self.guard = guard
        self.cache = cache  # (built first: the step boundary reads it too)
        self.boundary = boundary  # counts the step when the update goes ahead
        #: A closure evaluated again within one step (LBFGS): its window is checked.
        self.evaluated = evaluated
        self.window = window
        self.read_params_every_step = read_params_every_step
        self.stepped = False  # set by the pre-hook; AMP reads and clears it
        self.stepped_once = False  # params/state are checked from the 2nd boundary on
        self._queued = False  # params/state of the last step are already in the buffer
        self._rules = GroupRules(optimizer)
        #: The state is finite as far as the proof goes (see state_follows);
        #: a state that was there before nand is not known to be.
        self.state_trusted = state_follows(optimizer) and not optimizer.state
        self._state_due = False  # the last step's state is checked (read next boundary)
        #: An upper bound on every parameter's max|x| (None: not known, read them).
        self._bound: float | None = None
        #: And on every momentum buffer's (SGD; 0 before the first update).
        self._buffer_bound: float | None = None if optimizer.state else 0.0
        self._params_due = True  # the last step's parameters are checked
        self.handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_load_state_dict_post_hook(self._loaded),
        ]
        self._post_hooked = False  # the post-hook is there only for large models
        self._found_inf: Tensor | None = None  # the found_inf nand set, until the step ends
        self._device_hooked = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def drop_grads(self) -> None:
        """Skip this step: no gradient, no update (see module docstring)."""
        for p in self.cache.params():
            p.grad = None

    # --- the step boundary ----------------------------------------------------

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """The optimizer's step pre-hook, before anything is applied.

        Without a closure the gradients are ready: the step boundary runs now.
        With one (``step(closure)``: Lightning's automatic optimization, LBFGS)
        the forward and backward run inside ``step``, after this hook, so the
        closure is replaced by one that runs the boundary as soon as it
        returns: still before the update, with this step's window complete.
        """
        if self.guard.off:
            return None
        closure = _closure_of(args, kwargs) if len(args) > 1 or kwargs else None
        if closure is None:
            self._at_boundary()
            return None
        closure = self._then_boundary(closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure}
        return (args[0], closure, *args[2:]), kwargs

    def _then_boundary(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, followed by the step boundary after its first call.

        An optimizer may call it again within the same step (LBFGS's line
        search evaluates the model several times): each later evaluation's
        window is checked as it returns, as micro-steps of the same step.
        """
        calls = 0

        def closure_then_boundary() -> Any:
            nonlocal calls
            loss = closure()
            calls += 1
            if self.guard.off:
                return loss
            if calls == 1:
                self._at_boundary()
            else:
                self.evaluated(calls - 1)
            return loss

        return closure_then_boundary

    def _at_boundary(self) -> None:
        """Before the update: the norm launch, the boundary's read and policy,
        then the plan for what the update writes."""
        self.stepped = True
        state_read = self._state_due  # this window holds the state (see add_norms)
        try:
            self.add_norms(with_params=self.stepped_once)
        except Exception as exc:
            self.guard.failed(exc, "optimizer pre-step hook")
            return
        # If the boundary raises, the next boundary reads params and state.
        self._params_due = self._state_due = True
        self.boundary()  # guarded itself; may raise NonFiniteError / StopRequested
        if self.guard.off:
            return  # switched off by its own error
        self.stepped_once = True  # the update goes ahead
        try:
            if self.window.flag is not None:
                self._skip_on_device(self.window.flag)
            self._plan(state_read)
        except Exception as exc:
            self.guard.failed(exc, "optimizer pre-step hook")

    def _plan(self, state_read: bool) -> None:
        """After this step's read, before its update: must the next boundary
        read what this update writes? Everything the answer depends on is known
        here: this window's norms and the hyperparameters this update uses."""
        self._refresh()
        self._rules.update()
        clean = self.window.clean
        # The state this update writes is finite by state_follows when the
        # window (this step's gradients, and the state itself when read) was.
        if (
            self.cache.state_half
            or not clean
            or not self._rules.follows
            or self.read_params_every_step
        ):
            self.state_trusted = False  # checked at every step until proven again
        elif state_read:
            self.state_trusted = True  # read finite, and finite gradients go in
        self._state_due = not self.state_trusted
        self._bound = self._bound_after(clean)
        self._params_due = self._bound is None

    def _bound_after(self, clean: bool) -> float | None:
        """A bound on every parameter's max|p| after this update, or None."""
        norms, spans = self.window.read_norms, self.window.read_spans
        before = _max_read(norms, spans["param"]) if "param" in spans else self._bound
        buffer = _max_read(norms, spans["state"]) if "state" in spans else self._buffer_bound
        start, n = spans.get("grad", (0, 0))
        grad_max = max(norms[start : start + n]) if n else 0.0
        terms = self._rules.terms
        if buffer is not None and clean and self.state_trusted:
            self._buffer_bound = buffer_after_update(buffer, before, terms, grad_max)
        else:
            self._buffer_bound = None
        if before is None or self._buffer_bound is None or not clean or not self.state_trusted:
            return None
        groups = self.optimizer.param_groups
        after = bound_after_update(before, terms, groups, grad_max, self._buffer_bound)
        # Writing p - step rounds once more: a relative ulp or two of the dtype.
        if after is None or after * self.cache.rounding >= self.cache.limit:
            return None
        return after * self.cache.rounding

    def _skip_on_device(self, flag: Tensor) -> None:
        """The fused kernel skips this update where ``flag`` is 1 (see the module
        docstring); a GradScaler's ``found_inf`` is kept: the larger of the two."""
        opt = self.optimizer
        found = vars(opt).get("found_inf")
        if found is None or found is self._found_inf:  # (ours, left by a step that raised)
            opt.found_inf = self._found_inf = flag  # type: ignore[attr-defined]
            if not self._device_hooked:  # removed when the step ends, by a post-hook
                self._device_hooked = True
                self.handles.append(opt.register_step_post_hook(self._stepped_on_device))
        else:  # the scaler's, which it deletes after the step itself
            opt.found_inf = torch.maximum(found, flag.to(found.device))  # type: ignore[attr-defined]
            self._found_inf = None

    def take_stepped(self) -> bool:
        """Whether the optimizer stepped since the last call (for the AMP watch)."""
        stepped, self.stepped = self.stepped, False
        return stepped

    def _stepped_on_device(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._found_inf is not None and vars(optimizer).get("found_inf") is self._found_inf:
            del optimizer.found_inf
        self._found_inf = None

    # --- parameters and state ---------------------------------------------------

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Large models: the parameters and state, right after the update wrote
        them, while still in cache (the same multi-tensor pass costs less than
        at the next step)."""
        if self.guard.off:
            return
        try:
            self._refresh()  # the state's tensors exist from the first update on
            if not self.cache.large:
                return  # (now small): the next pre-hook takes them with the gradients
            self._add_params_and_state()
            self._queued = True
        except Exception as exc:
            self.guard.failed(exc, "optimizer post-step hook")

    def _refresh(self) -> None:
        if self.cache.refresh():
            self._bound = None  # new parameters: read them first
            if self.cache.large:
                self._hook_post()

    def _hook_post(self) -> None:
        """Register the post-hook once the parameters and state are found large.

        Never removed before ``remove``: this may run while the optimizer
        iterates its post-hooks (from :meth:`_post`)."""
        if not self._post_hooked:
            self._post_hooked = True
            self.handles.append(self.optimizer.register_step_post_hook(self._post))

    def _loaded(self, optimizer: Any) -> None:
        # New state tensors, not checked yet; what the buffer holds is the old.
        self.state_trusted = self._state_due = False
        self._buffer_bound = None  # known again once the new state is read
        self.cache.forget_state()

    def add_norms(self, with_params: bool, force: bool = False) -> None:
        """Grads, and (``with_params``) params and state when due: one foreach launch.

        ``force``: the parameters even if implied finite (the last look at
        ``close``).
        """
        cache = self.cache
        grads = list(map(GRAD, cache.params()))  # (C loops: no bytecode per parameter)
        sites: list[Site]
        if cache.grads_plain and not any(map(is_, grads, repeat(None))):
            sites = cache.grad_sites  # every parameter has a plain gradient: the common case
        else:
            grads, sites = cache.usable_grads()
        buf = self.buf
        buf.spans["grad"] = (len(buf.norms), len(grads))
        if with_params and not self._queued and self._written_due(force):
            sites = list(sites)  # not the cached list
            self._take_params_and_state(grads, sites)
        self._queued = False
        try:
            buf.add_norms(grads, sites)
        except (NotImplementedError, RuntimeError):
            if not cache.grads_plain:
                raise
            cache.grads_plain = False  # a sparse gradient: filter them from now on
            self.add_norms(with_params, force)

    def add_skipped(self) -> None:
        """A GradScaler skipped this step's update, so no pre-hook ran: what the
        last update wrote joins this window all the same, when due (a small
        model's would have ridden the pre-hook's launch). Without it a
        deferred read, which has no tensors left to look behind a forward
        finding with, would blame the layer that a bad weight made non-finite."""
        if self.guard.off or not self.stepped_once or self._queued:
            return
        try:
            if self._written_due():
                self._add_params_and_state()
        except Exception as exc:
            self.guard.failed(exc, "GradScaler-skipped step")

    def _written_due(self, force: bool = False) -> bool:
        """Whether this window must read the parameters or state the last
        update wrote (``force``: the parameters even if implied finite)."""
        self._params_due |= force or self.read_params_every_step
        if not (self._params_due or self._state_due):
            return False
        self._refresh()
        return True

    def _add_params_and_state(self) -> None:
        tensors: list[Tensor] = []
        sites: list[Site] = []
        self._take_params_and_state(tensors, sites)
        self.buf.add_norms(tensors, sites)

    def _take_params_and_state(self, tensors: list[Tensor], sites: list[Site]) -> None:
        """Append the parameters and the state, each unless implied finite."""
        cache = self.cache
        if self._params_due:
            params, param_sites = cache.params_only
            self.buf.spans["param"] = (len(self.buf.norms) + len(tensors), len(params))
            tensors += params if cache.plain else [local(t) for t in params]
            sites += param_sites
        if self._state_due:
            state, state_sites = cache.state
            self.buf.spans["state"] = (len(self.buf.norms) + len(tensors), len(state))
            tensors += state if cache.plain else [local(t) for t in state]
            sites += state_sites


def _max_read(norms: list[float], span: tuple[int, int]) -> float | None:
    """The largest of the norms read in ``span`` (each bounds its tensor's
    max|x|), or None if one of them is not finite."""
    start, n = span
    read = norms[start : start + n]
    return max(read, default=0.0) if math.isfinite(sum(read)) else None
