"""Sharded optimizers (``ZeroRedundancyOptimizer``): which rank made a
non-finite parameter, and which ones only received it.

ZeRO splits the parameters into one shard per rank. In ``step`` each rank's
local optimizer (``zero.optim``) updates its own shard only, with its own
hyper-parameters and optimizer state; then every rank broadcasts its shard to
the others (``_sync_params``). A parameter that another rank's update made
non-finite therefore arrives here through that broadcast:

- a non-finite parameter in this rank's own shard was made here: ``produced``
  (the update read finite gradients, or a ``grad`` finding would come first);
- one in another rank's shard, while this rank's own shard is finite, was
  ``received``, through "ZeRO's parameter broadcast" (``VIA_ZERO_BROADCAST``);
- when every rank's own shard went non-finite, each rank reports its own:
  all of them made one.

The optimizer state lives in ``zero.optim.state``, for this rank's shard only
(``zero.state`` stays empty): :func:`state_keeper` says where the parameter cache
reads. ``overlap_with_ddp=True`` (a functional local optimizer, updated from
DDP's communication hook) is not covered.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch
from torch import Tensor

from nand.events import VIA_ZERO_BROADCAST


def is_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer`` (with its local one)."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # (torch built without distributed)
        return False
    return isinstance(optimizer, ZeroRedundancyOptimizer) and hasattr(optimizer, "optim")


def state_keeper(optimizer: Any) -> Any:
    """The optimizer whose ``state`` holds the per-parameter state: a ZeRO
    optimizer's local one (its own shard's; read ``.state`` each time:
    ``load_state_dict`` replaces it)."""
    return optimizer.optim if is_zero(optimizer) else optimizer


class ZeroShard:
    """Which parameters this rank's local optimizer updates, and who updates
    the others (``ZeroRedundancyOptimizer``'s partition, read when asked:
    ``add_param_group`` partitions again)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def own_ids(self) -> set[int]:
        """The ids of the parameters in this rank's shard."""
        return {id(q) for group in self.optimizer.optim.param_groups for q in group["params"]}

    def owns(self, p: Tensor) -> bool:
        return id(p) in self.own_ids()

    def owner(self, p: Tensor) -> int | None:
        """The global rank whose shard holds ``p`` (None: not known)."""
        rank = getattr(self.optimizer, "_param_to_rank", {}).get(p)
        if rank is None:
            return None
        import torch.distributed as dist

        return int(dist.get_global_rank(self.optimizer.process_group, rank))

    def first_own_bad(self, params: list[Tensor]) -> Tensor | None:
        """The first of ``params`` in this rank's shard that is non-finite."""
        own = self.own_ids()
        for p in params:
            if id(p) in own and not bool(torch.isfinite(p).all()):
                return p
        return None


class ParamSites(Protocol):
    """What :func:`settle_zero` needs of the parameter cache (``ParamCache``)."""

    zero: ZeroShard | None

    #: The usable parameters, in the order their findings follow, and their sites.
    params_only: tuple[list[Tensor], list[Any]]

    def param_site(self, p: Tensor) -> Any: ...


def settle_zero(finding: Any, cache: ParamSites | None) -> Any:
    """A non-finite parameter found on this rank (an ``analysis.Finding`` of
    phase ``param``), settled against ZeRO's partition (see the module
    docstring): this rank's own shard first, else received through the
    broadcast. Anything else is returned as it is."""
    shard = cache.zero if cache is not None else None
    if shard is None or finding is None or finding.phase != "param":
        return finding
    p = finding.site.param
    if p is None or shard.owns(p):
        return finding
    assert cache is not None
    params = cache.params_only[0]
    own = shard.first_own_bad(params)
    if own is not None:  # this rank's own update made one too: that one is its finding
        site = cache.param_site(own)
        order = next(i for i, q in enumerate(params) if q is own)
        return dataclasses.replace(
            finding,
            site=site,
            module=site.module,
            module_type=site.module_type,
            tensor=own,
            order=order,
            lo=math.nan,
            hi=math.nan,
        )
    owner = shard.owner(p)
    who = f"rank {owner}'s" if owner is not None else "another rank's"
    note = f"updated by {who} shard of the ZeRO optimizer; {VIA_ZERO_BROADCAST} brought it here"
    finding.cause, finding.via = "received", VIA_ZERO_BROADCAST
    finding.note = f"{finding.note}; {note}" if finding.note else note
    return finding
