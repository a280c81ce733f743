"""The deferred read: a step's results read at the next boundary, not now.

On CUDA the one read per step (``tolist()`` of the gathered probe results)
makes the host wait for the device. Deferred, the boundary instead copies
the gathered tensor with ``non_blocking=True`` into a pinned host buffer and
records a CUDA event; the copy of the *previous* boundary is read now. By
then its event has almost always completed (the device has since run this
step's forward and backward), so the read does not wait. When it has not
(the host is more than a step ahead), the read waits for that event, which
is counted in :attr:`DeferredRead.waits` (a wait on a step that is done
launching, not on the queue: the device keeps working through this step's
kernels meanwhile).

Two host buffers: a copy never lands in the one still to be read. The same
code runs on CPU, where the copy is a plain synchronous copy and there is no
event, so the tests exercise the ordering on any machine.

>>> import torch
>>> read = DeferredRead()
>>> read.put(torch.tensor([1.0, 2.0]), "step 0")
>>> read.put(torch.tensor([3.0]), "step 1")
>>> read.take()
([1.0, 2.0], 'step 0')
>>> read.take(), read.take()
(([3.0], 'step 1'), None)
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from nand.agent import patches
from nand.agent.detect.optimizer import skips_on_device
from nand.config import AgentConfig

T = TypeVar("T")
log = logging.getLogger("nand")


def read_mode(settings: AgentConfig, model: nn.Module, optimizer: Any) -> tuple[bool, bool]:
    """(read deferred, skip on the device) for a watch of ``model``.

    ``read="auto"`` defers on CUDA where the policy allows it: ``warn``, and
    ``skip`` when the optimizer skips an update on the device (see
    ``optimizer.skips_on_device``); ``raise``/``stop`` and any other ``skip``
    need the decision on the host before the update, so they read in sync.
    ``read="deferred"`` defers on any device (CPU too: the tests), but a
    ``skip`` the optimizer cannot do on the device falls back to sync, said once.

    In the light mode every policy defers as ``skip`` does, and skips a step
    that went non-finite on the device, ``warn`` included: its replay, one
    step late, must run with the weights the step ran with (``rerun``).
    Without an optimizer the weights stay as they are. With one that cannot
    skip on the device ``auto`` reads in sync; ``deferred`` defers all the
    same, as asked, and the first incident is then not replayed.
    """
    policy, read = settings.on_nonfinite, settings.read
    if read == "sync" or policy.reads_in_sync or settings.disabled:
        return False, False
    p = next(model.parameters(), None)
    wanted = read == "deferred" or (p is not None and p.is_cuda)
    light = settings.mode == "light"
    if not (policy.skips_update or light) or not wanted:
        return wanted, False
    if optimizer is not None and skips_on_device(optimizer):
        return True, True
    if light and not policy.skips_update and (optimizer is None or read == "deferred"):
        return True, False
    if read == "deferred":
        log.warning(
            "nand: read='deferred' with on_nonfinite='skip' needs an optimizer that skips "
            "on the device (fused Adam, AdamW, or SGD without momentum): reading in sync"
        )
    elif light and not policy.skips_update:
        log.info(
            "nand: mode='light' reads each step in sync: a replay needs the step's weights, "
            "and only a fused Adam, AdamW or SGD without momentum keeps them read late"
        )
    return False, False


class DeferredRead(Generic[T]):
    """Copies of gathered tensors waiting to be read, oldest first, with what
    the caller needs to make sense of each (``meta``)."""

    #: Host buffers, and so copies that can be in flight at once.
    BUFFERS = 2

    def __init__(self) -> None:
        self._free: list[Tensor] = []
        #: (host buffer or None, values in it, the copy's event or None, meta)
        self._pending: deque[tuple[Tensor | None, int, Any, T]] = deque()
        self.waits = 0  # reads that had to wait for their copy (CUDA only)

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, gathered: Tensor | None, meta: T) -> None:
        """Start copying ``gathered`` (None: a window with nothing to read) to
        the host; it is read by a later :meth:`take`, with ``meta``."""
        if gathered is None:
            self._pending.append((None, 0, None, meta))
            return
        if len(self._pending) >= self.BUFFERS:
            raise RuntimeError("deferred read: a copy would overwrite one not read yet")
        n = gathered.numel()
        host = self._buffer(n, gathered)
        event = None
        if gathered.is_cuda:  # (the CUDA-only lines: an asynchronous copy, and its event)
            host[:n].copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        else:
            host[:n].copy_(gathered)
        self._pending.append((host, n, event, meta))

    def take(self) -> tuple[list[float] | None, T] | None:
        """The oldest copy's values (None: the window had none) and its meta,
        or None when nothing is pending. Waits only if its copy is not done."""
        if not self._pending:
            return None
        host, n, event, meta = self._pending.popleft()
        if host is None:
            return None, meta
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        values = host[:n].tolist()
        self._free.append(host)
        return values, meta

    def _buffer(self, n: int, like: Tensor) -> Tensor:
        """A free host buffer of ``like``'s dtype for ``n`` values, pinned for a
        CUDA copy; made (or made larger) when none fits."""
        for i, host in enumerate(self._free):
            if host.dtype == like.dtype and host.numel() >= n:
                return self._free.pop(i)
        if self._free:
            self._free.pop(0)  # too small, or another dtype: replaced
        size = max(64, 2 * n)
        return torch.empty(size, dtype=like.dtype, pin_memory=like.is_cuda)


#: Flushes to run at interpreter exit, held weakly (a closed watch's goes away).
_at_exit: list[weakref.WeakMethod[Callable[[], None]]] = []


def flush_at_exit(flush: Callable[[], None]) -> None:
    """Call ``flush`` (a bound method) at interpreter exit, while its object
    lives: a watch never closed still reports the window it had not read.
    Registered on first use, so it runs before the transport's own exit
    handler (registered at import, and ``atexit`` runs the last first)."""
    patches.at_exit("deferred reads", _flush_all)  # (once)
    _at_exit[:] = [ref for ref in _at_exit if ref() is not None]  # (watches gone)
    _at_exit.append(weakref.WeakMethod(flush))


def _flush_all() -> None:
    for ref in list(_at_exit):
        flush = ref()
        if flush is not None:
            flush()
    _at_exit.clear()
