"""Optimizer step hooks: the step boundary, and grad/param/state checks.

- **pre-hook** (before ``optimizer.step`` applies anything): one
  ``_foreach_norm`` over the ``.grad`` of every parameter, then the step
  boundary runs (``Watch._boundary``): the one host read, the policy. Raising
  here (``raise``/``stop``) leaves the weights untouched.
- **skip** drops the step by setting every ``.grad`` to ``None``: optimizers
  skip parameters without a gradient (no update, no weight decay, no step
  count). On a GPU with a fused optimizer the same could be done without a
  host read by setting ``optimizer.found_inf`` to the device-side flag, as
  ``GradScaler`` does; that path is not implemented (no GPU to test it on).
- **post-hook**: one ``_foreach_norm`` over the parameters and over the float
  optimizer state (Adam's ``exp_avg``/``exp_avg_sq``; ``step`` counters are
  skipped). These results are read with the *next* step's boundary (or at
  close) — never a second read per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from nand.agent.probes import ProbeBuffer, Site
from nand.agent.safety import Guard


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
    ) -> None:
        self.optimizer = optimizer
        self.buf = buf
        self.guard = guard
        self.names = names  # param -> (qualified name, owning module type)
        self.boundary = boundary
        self.after_step = after_step
        self.stepped = False  # set by the pre-hook; AMP reads and clears it
        self._sites: dict[tuple[int, str, str], Site] = {}
        self.handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def drop_grads(self) -> None:
        """Skip this step: no gradient, no update (see module docstring)."""
        for p in self.params():
            p.grad = None

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.guard.off:
            return
        self.stepped = True
        try:
            self.add_grad_norms()
        except Exception as exc:
            self.guard.failed(exc, "optimizer pre-step hook")
            return
        self.boundary()  # guarded itself; may raise NonFiniteError / StopRequested

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.guard.off:
            return
        try:
            self.after_step()
            self.add_param_and_state_norms()
        except Exception as exc:
            self.guard.failed(exc, "optimizer post-step hook")

    def add_grad_norms(self) -> None:
        grads: list[Tensor] = []
        sites: list[Site] = []
        for p in self.params():
            g = p.grad
            if g is not None and _usable(g):
                grads.append(g)
                sites.append(self._site(p, "grad", ""))
        self.buf.add_norms(grads, sites)

    def add_param_and_state_norms(self) -> None:
        tensors, sites = [], []
        for p in self.params():
            if _usable(p):
                tensors.append(p)
                sites.append(self._site(p, "param", ""))
        for p in self.params():
            for key, value in self.optimizer.state.get(p, {}).items():
                if key != "step" and _usable(value):
                    tensors.append(value)
                    site = self._site(p, "optimizer_state", str(key))
                    site.param = value
                    sites.append(site)
        self.buf.add_norms(tensors, sites)

    def _site(self, p: Tensor, phase: str, key: str) -> Site:
        site = self._sites.get((id(p), phase, key))
        if site is None:
            name, owner_type = self.names.get(p, (f"param{len(self._sites)}", ""))
            module = f"{name}:{key}" if key else name
            site = Site(phase, module, owner_type, -1, key, "norm", param=p, state_key=key)
            self._sites[(id(p), phase, key)] = site
        return site
