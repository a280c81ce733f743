"""Replica fingerprints: do the data-parallel ranks still hold the same weights?

Under DDP every rank should hold bit-identical parameters after every update.
A replica that drifts (a flipped bit in a GEMM, a bad memory cell) stays
finite and trains on, and nothing else in nand would see it. Every
``NAND_FINGERPRINT_STEPS`` steps each rank computes, on the device, one
integer per parameter: the sum of its elements' **bit patterns** (the float
viewed as an integer of its width, summed in int64). Integer addition is
exact and order-free, so healthy replicas give identical numbers however a
kernel orders its reduction (a float sum would not: GPU reductions may
differ from run to run), and any single flipped bit changes the sum by ±2^k.
Two flips could cancel; one cannot. The server compares ranks at the same
step; the training job runs no extra collective.

The fingerprint is taken at the step boundary, before the update, so step S
means "the parameters after S updates" on every rank. It is copied towards
the host without waiting (``deferred.DeferredRead``) and sent at the next
boundary, after that step's one read. At a clean close each rank takes one
more, of the state after its last step, so drift after the last scheduled
fingerprint is still bracketed (up to the last step); after an exception it
does not (an update may be half applied). A rank that ended early (crashed)
has no fingerprint at the others' last step, and the server compares only
fingerprints of the same step. Cost: one pass over the parameters every N
steps (figures in ``benchmarks/README.md``). Only where ranks hold the same
tensors: DDP's full replicas, and under HSDP (FSDP2 on a mesh with a
replicate dimension) the ranks that hold the same shard. Each fingerprint
names its replica group (this rank's coordinates on the sharded mesh
dimensions: ``[]`` under DDP) and the server compares within groups. Plain
FSDP shards differ by design: nothing to compare.

The optimizer's per-element state is replicated too (SGD's momentum, Adam's
``exp_avg`` and ``exp_avg_sq``): each such tensor of a parameter's state is
fingerprinted with it, named ``"<param>:<key>"``. A corrupted moment shows
there first, a step before it reaches the weights. Not for optimizers whose
state is sharded across ranks by design (``ZeroRedundancyOptimizer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from nand.agent.step.deferred import DeferredRead
from nand.config import AgentConfig

#: The integer type with the width of each float type (its bit pattern).
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}

#: ``send(step, names, values, group)``: hands a fingerprint to the outputs.
Send = Callable[[int, list[str], list[int], list[int]], None]


def fingerprint(tensors: Sequence[Tensor]) -> Tensor:
    """One int64 per tensor: the sum of its elements' bit patterns (device-side).

    >>> a = torch.tensor([1.0, 2.0])
    >>> b = a.clone(); b.view(torch.int32)[0] ^= 1  # the lowest mantissa bit of one element
    >>> bool(fingerprint([a]) != fingerprint([b]))
    True
    """
    sums = [_local(t).detach().view(_BITS[t.dtype]).sum(dtype=torch.int64) for t in tensors]
    return torch.stack(sums)


def _local(t: Tensor) -> Tensor:
    """An FSDP2 parameter's (DTensor's) own shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def replica_group(params: Sequence[Tensor]) -> list[int] | None:
    """Which ranks hold the same tensors as this one: this rank's coordinates
    on the mesh dimensions the parameters are sharded on (``[]``: full
    replicas, as under DDP). None when no other rank holds this rank's shards
    (FSDP without a replicate dimension). FSDP2 puts every parameter of a
    model on one mesh with the same placements: the first one tells.
    """
    sharded = next((p for p in params if hasattr(p, "placements")), None)
    if sharded is None:
        return []
    mesh, placements = sharded.device_mesh, sharded.placements  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    replicate = [i for i, placement in enumerate(placements) if placement.is_replicate()]
    if coordinate is None or math.prod(mesh.size(i) for i in replicate) < 2:
        return None
    return [coordinate[i] for i in range(len(placements)) if i not in replicate]


class Outputs(Protocol):
    """Where fingerprints go (``output.session.Session``)."""

    per_step: bool

    @property
    def world_size(self) -> int: ...

    def fingerprint(
        self, step: int, names: list[str], values: list[int], group: list[int]
    ) -> None: ...


class Fingerprints:
    """Takes a fingerprint every ``every`` steps and sends it one boundary later."""

    @classmethod
    def wanted(
        cls, settings: AgentConfig, root: nn.Module, outputs: Outputs, optimizer: object = None
    ) -> Fingerprints | None:
        """For a watch with a server and other ranks to compare with, else None."""
        if not settings.fingerprint_steps or outputs.world_size < 2 or not outputs.per_step:
            return None
        return cls(
            settings.fingerprint_steps, root, outputs.fingerprint, replicated_state(optimizer)
        )

    def __init__(
        self,
        every: int,
        root: nn.Module,
        send: Send,
        state: Mapping[Tensor, Mapping[str, object]] | None = None,
    ) -> None:
        self.every = every
        self.send = send
        named = [(n, p) for n, p in root.named_parameters() if p.dtype in _BITS]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.state = state  # the optimizer's, per parameter (None: not fingerprinted)
        self.group = replica_group(self.params)  # (None: no rank to compare with)
        self._copies: DeferredRead[tuple[int, list[str]]] = DeferredRead()
        self.taken = 0  # fingerprints taken, for tests
        self.last_step: int | None = None  # the step of the last one taken

    def at_boundary(self, step: int, reduced: bool) -> None:
        """Send the fingerprint taken at the last boundary, then take this
        step's if it is due and a wrapper (``reduced``: DDP, FSDP) keeps other
        ranks' tensors equal to this rank's."""
        self._send(self._copies.take())
        if self.every and step % self.every == 0:
            self._take(step, reduced)

    def at_end(self, step: int | None, reduced: bool) -> None:
        """At close: take one of the state after the run's last step (None:
        the close followed an exception, perhaps mid-update, so there is no
        such state) unless it was taken already, then send what is pending."""
        if step is not None and step != self.last_step:
            self._take(step, reduced)
        self.flush()

    def _take(self, step: int, reduced: bool) -> None:
        if reduced and self.params and self.group is not None:
            names, tensors = self._tensors()
            self._copies.put(fingerprint(tensors), (step, names))
            self.taken += 1
            self.last_step = step

    def _tensors(self) -> tuple[list[str], list[Tensor]]:
        """The parameters, then each one's per-element optimizer state (which
        appears at the first update: the list is made anew each time)."""
        names, tensors = list(self.names), list[Tensor](self.params)
        for name, param in zip(self.names, self.params, strict=True):
            for key, value in (self.state or {}).get(param, {}).items():
                if isinstance(value, Tensor) and _per_element(value, param):
                    names.append(f"{name}:{key}")
                    tensors.append(value)
        return names, tensors

    def flush(self) -> None:
        """At close: send what was taken and not sent yet."""
        while len(self._copies):
            self._send(self._copies.take())

    def _send(self, taken: tuple[list[float] | None, tuple[int, list[str]]] | None) -> None:
        values, (step, names) = taken if taken is not None else (None, (0, []))
        if values is not None:
            self.send(step, names, [int(v) for v in values], self.group or [])


def ended_cleanly(reason: str, switched_off: bool = False) -> bool:
    """A close whose ``reason`` (the ``bye``'s) leaves the state that of the
    step counted last: the loop's end, or a stop agreed by every rank
    (``StopRequested``); not an exception, which may have left an update
    half applied, nor a watch that ``switched_off`` (by its own error: it
    counts no more steps, while the loop trains on).

    >>> ended_cleanly("closed"), ended_cleanly("exception: StopRequested")
    (True, True)
    >>> ended_cleanly("exception: RuntimeError"), ended_cleanly("closed", switched_off=True)
    (False, False)
    """
    clean = not reason.startswith("exception:") or reason == "exception: StopRequested"
    return clean and not switched_off


def _per_element(state: Tensor, param: Tensor) -> bool:
    """A state tensor with one entry per parameter element (not Adam's step)."""
    return state.shape == param.shape and state.dtype in _BITS


def replicated_state(optimizer: object) -> Mapping[Tensor, Mapping[str, object]] | None:
    """The optimizer's per-parameter state, if every DDP rank holds all of it."""
    inner = getattr(optimizer, "optimizer", optimizer)  # (accelerate's, Lightning's wrappers)
    if not isinstance(inner, torch.optim.Optimizer) or type(inner).__name__ in SHARDED_STATE:
        return None
    return inner.state


#: Optimizers whose state each rank holds only part of, by design.
SHARDED_STATE = frozenset({"ZeroRedundancyOptimizer"})
