"""The optimizer's parameters and float state as flat lists, with their sites.

The optimizer hooks hand these lists to one ``_foreach_norm`` a step, so they
are built once and rebuilt only when the parameter groups or the state's keys
change (a group added when unfreezing, the state created by the first update
or replaced by ``load_state_dict``).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
from torch import Tensor

from nand.agent.detect.probes import Site, local
from nand.agent.detect.zero import ZeroShard, is_zero, state_keeper
from nand.events import Phase

#: Parameters and state smaller than this (bytes) are checked in the next
#: pre-hook's launch rather than in a launch of their own after the update.
FUSE_BELOW_BYTES = 1 << 20

GRAD = attrgetter("grad")


def usable(t: Any) -> bool:
    """A tensor a norm can be taken of: dense, floating point, not empty."""
    return isinstance(t, Tensor) and t.is_floating_point() and not t.is_sparse and t.numel() > 0


class ParamCache:
    """Flat lists of one optimizer's parameters, gradients' sites and state."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[Any, tuple[str, str]]):
        self.optimizer = optimizer
        self.names = names  # param -> (qualified name, owning module type)
        self._params_seen = (-1, -1)  # (groups, parameters) the lists were made from
        self._params_version = 0  # bumped when they are remade
        self._params: list[Tensor] = []
        self.grad_sites: list[Site] = []  # one per parameter, in order
        #: Every gradient can go straight into one ``_foreach_norm``: no DTensor
        #: (its local shard is read instead) and none sparse (no kernel) so far.
        self.grads_plain = True
        self._collected = (-1, -1)  # (params version, states) the lists were collected at
        self.params_only: tuple[list[Tensor], list[Site]] = ([], [])
        self.state: tuple[list[Tensor], list[Site]] = ([], [])
        self.plain = True  # no DTensor among params/state: no local() per step
        self.large = False  # params and state too large to ride with the next grads
        self.state_half = False  # float16 state: g*g can overflow it
        self.limit = 0.0  # parameter bounds above this are too close to the dtype's limit
        self.rounding = 1.0  # 1 + 4 eps of the coarsest parameter dtype
        self._by_module: dict[str, list[Tensor]] | None = None
        self._sites: dict[tuple[int, str, str], Site] = {}
        #: ZeRO: this rank updates its own shard only, and keeps only its state.
        self.zero = ZeroShard(optimizer) if is_zero(optimizer) else None
        self._keeper = state_keeper(optimizer)  # the optimizer whose .state holds it

    def params(self) -> list[Tensor]:
        """The optimizer's parameters (cached until the param groups change)."""
        groups = self.optimizer.param_groups
        # (called twice a step: one group, the common case, without a generator)
        count = (
            len(groups[0]["params"]) if len(groups) == 1 else sum(len(g["params"]) for g in groups)
        )
        if len(groups) != self._params_seen[0] or count != self._params_seen[1]:
            self._params_seen = (len(groups), count)
            self._params_version += 1
            self._params = [p for g in groups for p in g["params"]]
            self.grad_sites = [self._site(p, "grad", "") for p in self._params]
            self.grads_plain = not any(hasattr(p, "to_local") for p in self._params)
        return self._params

    def refresh(self) -> bool:
        """Rebuild the parameter and state lists if the parameters or the
        state's keys changed; whether they were rebuilt."""
        self.params()
        key = (self._params_version, len(self._keeper.state))
        if key == self._collected:
            return False
        self._collected = key
        self._collect()
        return True

    def forget_state(self) -> None:
        """The state was replaced (``load_state_dict``): collect it again."""
        self._collected = (-1, -1)

    def usable_grads(self) -> tuple[list[Tensor], list[Site]]:
        """The dense float gradients (local shards) and their sites."""
        tensors: list[Tensor] = []
        sites: list[Site] = []
        for p, site in zip(self.params(), self.grad_sites, strict=True):
            g = p.grad
            if g is not None and not g.is_sparse and g.is_floating_point():
                tensors.append(g if type(g) is Tensor else local(g))
                sites.append(site)
        return tensors, sites

    def params_of(self, module: str) -> list[Tensor]:
        """The watched parameters owned directly by ``module`` (its qualified name)."""
        if self._by_module is None:
            self._by_module = {}
            for p in self.params():
                name = self.names.get(p, ("", ""))[0]
                self._by_module.setdefault(name.rpartition(".")[0], []).append(p)
        return [p for p in self._by_module.get(module, []) if usable(p)]

    def params_behind(self, module: str) -> list[Tensor]:
        """The parameters a forward finding at ``module`` may come from: its
        own; at the root, every one after them (in the light mode the root's
        output is the only forward probe, and every module feeds it)."""
        own = self.params_of(module)
        if module:
            return own
        return own + [p for p in self.params() if usable(p) and not any(p is o for o in own)]

    def param_site(self, p: Tensor) -> Site:
        """Where a finding about parameter ``p`` itself is reported."""
        return self._site(p, "param", "")

    def _collect(self) -> None:
        params = [p for p in self.params() if usable(p)]
        self.params_only = (params, [self._site(p, "param", "") for p in params])
        self._by_module = None
        dtypes = {p.dtype for p in params}
        self.limit = min((torch.finfo(d).max for d in dtypes), default=0.0) / 1024
        self.rounding = 1.0 + 4 * max((torch.finfo(d).eps for d in dtypes), default=0.0)
        self.state = self._collect_state()
        everything = params + self.state[0]
        self.plain = not any(hasattr(t, "to_local") for t in everything)  # no DTensor
        self.large = sum(t.numel() * t.element_size() for t in everything) >= FUSE_BELOW_BYTES
        # Before the first update there is no state yet: it will take the
        # parameters' dtypes (what SGD, Adam and AdamW create).
        made_like = self.state[0] or params
        self.state_half = any(t.dtype == torch.float16 for t in made_like)

    def _collect_state(self) -> tuple[list[Tensor], list[Site]]:
        tensors: list[Tensor] = []
        sites: list[Site] = []
        for p in self.params():
            for name, value in self._keeper.state.get(p, {}).items():
                if name != "step" and usable(value):
                    tensors.append(value)
                    site = self._site(p, "optimizer_state", str(name))
                    site.param = value
                    sites.append(site)
        return tensors, sites

    def _site(self, p: Tensor, phase: Phase, key: str) -> Site:
        site = self._sites.get((id(p), phase, key))
        if site is None:
            name, owner_type = self.names.get(p, (f"param{len(self._sites)}", ""))
            module = f"{name}:{key}" if key else name
            site = Site(
                phase=phase, module=module, module_type=owner_type, slot=key, kind="norm", param=p
            )
            self._sites[(id(p), phase, key)] = site
        return site
