"""Each rank's own gradients, checked before DDP averages them.

After DDP's all-reduce every rank holds the same gradients, so a NaN that one
rank's backward made shows up in every rank's ``grad`` phase. To tell the rank
that *produced* it from the ranks that *received* it, nand wraps DDP's
all-reduce in a communication hook that first launches one reduction of the
rank's local gradient bucket, then does exactly what DDP does by default
(divide by the world size, all-reduce).

The reduction is the bucket's norm, accumulated in float32: one pass, cheaper
than an ``aminmax`` on CPU, and it answers two questions. Non-finite, this
rank's own gradients were (NaN and inf reach the norm; so does a finite
gradient whose squares overflow float32, a norm over 1.8e19, which is a
blow-up of this rank's making too). Finite, it is this rank's local gradient
norm, which the server compares with the other ranks' at the same step to
name a rank whose batch or hardware stands out (``nand.server.analysis.outliers``).
The 0-d norms stay on the device; at the step boundary they are combined in
float64 and read with everything else in the one host read, as the
``ddp_local`` extra.

DDP takes one communication hook. If the model already has one, nand leaves
it alone and goes without this check (grad events then say ``received``);
a user who registers a hook *after* ``nand.watch`` gets DDP's own error, so
register yours first. ``NAND_DDP_LOCAL_CHECK=0`` turns the check off.
"""

# No ``from __future__ import annotations`` here: DDP inspects the hook's
# annotations at run time and wants real types, not strings.
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket  # (torch.distributed's; DDP checks the type)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from nand.agent.detect.names import unwrap

log = logging.getLogger("nand")


class LocalGradCheck:
    """The per-step norm of this rank's own gradients, before the all-reduce
    (non-finite: they were not finite)."""

    def __init__(self) -> None:
        self._norms: list[Tensor] = []
        self.active = True  # DDP cannot unregister a hook: close() turns it into a no-op

    def hook(self, process_group: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        if self.active:  # device work only: one reduction launched, nothing read
            grads = bucket.buffer().detach()
            self._norms.append(torch.linalg.vector_norm(grads, dtype=torch.float32))
        return default_hooks.allreduce_hook(process_group, bucket)

    def close(self) -> None:
        self.active = False
        self._norms = []

    def take(self) -> Tensor | None:
        """The step's local gradient norm as a 0-d tensor, or None; resets.
        (Micro-steps without sync add no buckets: DDP reduces only at the last.)"""
        if not self._norms:
            return None
        total: Tensor = torch.linalg.vector_norm(torch.stack(self._norms), dtype=torch.float64)
        self._norms = []
        return total


def install(model: Any, enabled: bool = True) -> LocalGradCheck | None:
    """Register the check on a DistributedDataParallel model, when possible
    (``enabled``: ``NAND_DDP_LOCAL_CHECK``); a refusal is logged, never raised."""
    try:
        return _install(model) if enabled else None
    except Exception as exc:  # DDP refused the hook: go on without the local check
        log.warning("nand: DDP local gradient check not installed (%s)", exc)
        return None


def _install(model: Any) -> LocalGradCheck | None:
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    if getattr(model, "_comm_hooks", None):
        log.info("nand: DDP already has a communication hook; local gradient check off")
        return None
    check = LocalGradCheck()
    model.register_comm_hook(model.process_group, check.hook)
    return check


def find_wrapper(root: nn.Module, found: Callable[[nn.Module], None]) -> RemovableHandle:
    """Call ``found(wrapper)`` when a module that wraps ``root`` (DDP, FSDP1,
    compile; see ``names.unwrap``) is called; stop looking once one is, or
    once ``root`` is called on its own. Returns the handle that stops it.

    A global forward pre-hook, so every module call takes torch's slow path
    while it is there: until the first forward, or the caller's first step.
    """
    handle: RemovableHandle | None = None

    def look(module: nn.Module, args: Any) -> None:
        if module is root:
            assert handle is not None
            handle.remove()  # called on its own: nothing wraps it
        elif unwrap(module) == (root, True):
            assert handle is not None
            handle.remove()
            found(module)

    handle = register_module_forward_pre_hook(look)
    return handle


def grads_are_reduced(model: Any) -> bool:
    """Whether a wrapper averages gradients across ranks (DDP, FSDP1, FSDP2)."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # an older torch without FSDP2
        return isinstance(model, DistributedDataParallel)
    return isinstance(model, DistributedDataParallel | FSDPModule | FullyShardedDataParallel)


def params_are_gathered(model: Any) -> bool:
    """Whether a wrapper all-gathers each rank's parameter shard into every
    rank's forward (FSDP1, FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # an older torch without FSDP2
        return False
    return isinstance(model, FSDPModule | FullyShardedDataParallel)
