"""Optimizer step hooks: the step boundary, and grad/param/state checks.

- **pre-hook** (before ``optimizer.step`` applies anything): one
  ``_foreach_norm`` over the ``.grad`` of every parameter; then the step
  boundary runs (``Watch._on_step``): the one host read, the policy. Raising
  here (``raise``/``stop``) leaves the weights untouched.
- **post-hook**: counts the step, and launches one ``_foreach_norm`` over the
  parameters and float optimizer state (Adam's ``exp_avg``/``exp_avg_sq``;
  ``step`` counters skipped) right after the update wrote them, while they
  are still in cache (on CPU ~30% cheaper than the same pass at the next
  pre-hook). The results are read with the next step's boundary and labelled
  with this step (phase ``param``/``optimizer_state`` come after ``grad`` in
  the logical order); if the post-hook did not run (a raised step), the next
  pre-hook takes them instead; ``close`` reads the last step's. A small
  model's parameters and state (under :data:`FUSE_BELOW_BYTES`) stay in cache
  anyway: the next pre-hook takes them in the same launch as the gradients,
  one multi-tensor launch per step instead of two.
- **optimizer state implied finite**: for ``SGD``, ``Adam`` and ``AdamW``
  the state after an update is a convex or geometric mix of the state before
  and the gradient (``g``, ``g*g``; see :func:`state_follows`). When this
  step's window was read all finite (every gradient's 2-norm finite, so every
  ``g*g`` is too) and the state was finite before, it is finite after: only
  the parameters are checked. The state is checked again after a window with
  anything non-finite in it and after ``load_state_dict``, until a read finds
  it finite; always for float16 state and for every other optimizer.
- **skip** drops the step by setting every ``.grad`` to ``None``: optimizers
  skip parameters without a gradient (no update, no weight decay, no step
  count). On a GPU with a fused optimizer the same could be done without a
  host read by setting ``optimizer.found_inf`` to the device-side flag, as
  ``GradScaler`` does; that path is not implemented (no GPU to test it on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from nand.agent.probes import ProbeBuffer, Site, local
from nand.agent.safety import Guard

#: Parameters and state smaller than this (bytes) are checked in the next
#: pre-hook's launch rather than in a launch of their own after the update.
FUSE_BELOW_BYTES = 1 << 20


def state_follows(optimizer: torch.optim.Optimizer) -> bool:
    """Whether finite gradients keep this optimizer's state finite, step by step.

    Exact types only (a subclass may compute something else). SGD's momentum
    buffer is ``m*buf + (1-d)*g`` and Adam's moments ``b1*m + (1-b1)*g`` and
    ``b2*v + (1-b2)*g*g`` (``amsgrad``: a running max of those): finite from
    finite inputs when the coefficients lie in [0, 1). Coupled weight decay
    adds ``wd*p`` to ``g`` first, which is not bounded by the gradient's norm,
    so it voids the argument; AdamW's decoupled decay touches the parameters
    only. The learning rate never enters the state.
    """
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return False
    for group in optimizer.param_groups:
        decay = group.get("weight_decay", 0)
        if kind is torch.optim.SGD:
            if not (_unit(group.get("momentum", 0)) and _unit(group.get("dampening", 0), 1.0)):
                return False
            if decay != 0 and group.get("momentum", 0) != 0:
                return False
        else:
            betas = group.get("betas", (0.9, 0.999))
            if not all(_unit(b) for b in betas):
                return False
            decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
            if decay != 0 and not decoupled:
                return False
    return True


def _unit(value: Any, top: float = 1.0 - 1e-12) -> bool:
    """A plain number in [0, top] (a tensor hyperparameter is not proven)."""
    return isinstance(value, (int, float)) and 0.0 <= value <= top


def _usable(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point() and not t.is_sparse and t.numel() > 0


class OptimizerHooks:
    """Hooks one optimizer; ``boundary`` is called from the pre-hook."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buf: ProbeBuffer,
        guard: Guard,
        names: dict[Any, tuple[str, str]],
        boundary: Callable[[], None],
        after_step: Callable[[], None],
        window_clean: Callable[[], bool],
    ) -> None:
        self.optimizer = optimizer
        self.buf = buf
        self.guard = guard
        self.names = names  # param -> (qualified name, owning module type)
        self.boundary = boundary
        self.after_step = after_step
        self.window_clean = window_clean  # the last boundary read nothing non-finite
        self.stepped = False  # set by the pre-hook; AMP reads and clears it
        self.stepped_once = False  # params/state are checked from the 2nd boundary on
        self._queued = False  # params/state of the last step are already in the buffer
        self._params_key: tuple[int, int] | None = None
        self._params: list[Tensor] = []
        self._grad_sites: list[Site] = []
        self._state_key: tuple[object, int] | None = None
        self._with_state: tuple[list[Tensor], list[Site]] = ([], [])
        self._params_only: tuple[list[Tensor], list[Site]] = ([], [])
        self._plain = True  # no DTensor among params/state: no local() per step
        self._fuse = True  # params and state small: checked with the next grads
        self._state_half = False  # float16 state: g*g can overflow it
        #: The state is finite as far as the proof goes (see state_follows);
        #: a state that was there before nand is not known to be.
        self.state_trusted = state_follows(optimizer) and not optimizer.state
        self._state_due = False  # the last step's state is checked (read next boundary)
        self._sites: dict[tuple[int, str, str], Site] = {}
        self.handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
            optimizer.register_load_state_dict_post_hook(self._loaded),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def params(self) -> list[Tensor]:
        """The optimizer's parameters (cached until the param groups change)."""
        groups = self.optimizer.param_groups
        key = (len(groups), sum(len(g["params"]) for g in groups))
        if key != self._params_key:
            self._params_key = key
            self._params = [p for g in groups for p in g["params"]]
            self._grad_sites = []
        return self._params

    def drop_grads(self) -> None:
        """Skip this step: no gradient, no update (see module docstring)."""
        for p in self.params():
            p.grad = None

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.guard.off:
            return
        self.stepped = True
        try:
            self.add_norms(with_params=self.stepped_once)
            self._queued = False
        except Exception as exc:
            self.guard.failed(exc, "optimizer pre-step hook")
            return
        self.boundary()  # guarded itself; may raise NonFiniteError / StopRequested

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.guard.off:
            return
        self.stepped_once = True
        try:
            self.after_step()
            self._refresh()  # the state's tensors exist from the first update on
            self._state_due = not self._state_implied()
            if self._fuse:
                return  # the next pre-hook takes them, in the gradients' launch
            more, sites = self._params_and_state()
            # Right after the update, while the params and state are still in
            # cache: the same multi-tensor pass costs less than at the next step.
            self.buf.add_norms(more if self._plain else [local(t) for t in more], sites)
            self._queued = True
        except Exception as exc:
            self.guard.failed(exc, "optimizer post-step hook")

    def _loaded(self, optimizer: Any) -> None:
        # New state tensors, not checked yet; what the buffer holds is the old.
        self.state_trusted = self._state_due = False
        self._state_key = None

    def _state_implied(self) -> bool:
        """Whether the state this update wrote is finite by :func:`state_follows`.

        Called after the update; the window read just before it held this
        step's gradients and, when ``_state_due`` was set, the state before it.
        """
        checked = self._state_due
        if self._state_half or not self.window_clean() or not state_follows(self.optimizer):
            self.state_trusted = False  # checked at every step until proven again
        elif checked:
            self.state_trusted = True  # read finite, and finite gradients went in
        return self.state_trusted

    def add_norms(self, with_params: bool) -> None:
        """Grads, and (``with_params``) params and state: one foreach launch."""
        tensors: list[Tensor] = []
        sites: list[Site] = []
        params = self.params()
        if len(self._grad_sites) != len(params):
            self._grad_sites = [self._site(p, "grad", "") for p in params]
        for p, site in zip(params, self._grad_sites, strict=True):
            g = p.grad
            if g is not None and not g.is_sparse and g.is_floating_point():
                tensors.append(g if type(g) is Tensor else local(g))
                sites.append(site)
        if with_params and not self._queued:
            self._refresh()
            more, more_sites = self._params_and_state()
            tensors += more if self._plain else [local(t) for t in more]
            sites += more_sites
        self.buf.add_norms(tensors, sites)

    def _params_and_state(self) -> tuple[list[Tensor], list[Site]]:
        """The parameters, and the state unless it is implied finite (see ``_refresh``)."""
        return self._with_state if self._state_due else self._params_only

    def _refresh(self) -> None:
        """Rebuild the cached lists when the parameters or the state's keys change."""
        key = (self._params_key, len(self.optimizer.state))
        if key != self._state_key:
            self._state_key = key
            self._collect()

    def _collect(self) -> None:
        tensors, sites = [], []
        for p in self.params():
            if _usable(p):
                tensors.append(p)
                sites.append(self._site(p, "param", ""))
        self._params_only = (tensors[:], sites[:])
        for p in self.params():
            for name, value in self.optimizer.state.get(p, {}).items():
                if name != "step" and _usable(value):
                    tensors.append(value)
                    site = self._site(p, "optimizer_state", str(name))
                    site.param = value
                    sites.append(site)
        self._with_state = (tensors, sites)
        self._plain = not any(hasattr(t, "to_local") for t in tensors)  # no DTensor
        self._fuse = sum(t.numel() * t.element_size() for t in tensors) < FUSE_BELOW_BYTES
        state = tensors[len(self._params_only[0]) :]
        self._state_half = any(t.dtype == torch.float16 for t in state)

    def _site(self, p: Tensor, phase: str, key: str) -> Site:
        site = self._sites.get((id(p), phase, key))
        if site is None:
            name, owner_type = self.names.get(p, (f"param{len(self._sites)}", ""))
            module = f"{name}:{key}" if key else name
            site = Site(phase, module, owner_type, -1, key, "norm", param=p, state_key=key)
            self._sites[(id(p), phase, key)] = site
        return site
