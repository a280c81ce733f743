"""What the ranks agree on at a step boundary, through small all-reduces.

Each rank reads its own window. When the ranks must take one decision
(``skip``/``stop``), or when FSDP shares every rank's parameter shard with
all the others, one rank's window is not enough:

- :func:`with_agreed_flag`: the 0-d "anything non-finite here" flag,
  all-reduced (MAX) on the device every step and appended to the window, so
  it rides along in the step's one host read.
- :func:`shard_bad_elsewhere`: only once something was non-finite on some
  rank (every rank knows it from the flag, so every rank takes part): did
  another rank find its own parameter shard non-finite, while this rank's
  were finite? Under FSDP that shard was all-gathered into every rank's
  forward, so what this rank saw there it received; it did not produce it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nand.agent.safety import PeerGone
from nand.agent.step.analysis import Finding

#: A rank's own finding that FSDP's parameter all-gather carries to the others.
SHARD_PHASES = ("param", "optimizer_state")


def with_agreed_flag(gathered: Tensor | None, n_extras: int, device: torch.device) -> Tensor:
    """``gathered`` and, last, the flag all-reduced over the ranks (1: some
    rank's window held a non-finite value). The extras (loss, AMP scale…)
    do not count: they are not findings."""
    if gathered is None:
        flag = torch.zeros(1, device=device)
        gathered = torch.zeros(0, device=device)
    else:
        main = gathered[: gathered.numel() - n_extras]
        flag = (~torch.isfinite(main)).any().float().reshape(1)
    _all_reduce_max(flag, "the agreed non-finite flag")
    return torch.cat([gathered, flag.to(gathered.device)])


def shard_bad_elsewhere(finding: Finding | None, device: torch.device) -> bool:
    """Whether another rank's own parameter (or optimizer state) shard was
    non-finite and this rank's were not. Every rank must call it at the same
    boundary (after an agreed flag said something was non-finite)."""
    mine = finding is not None and finding.phase in SHARD_PHASES and finding.cause == "produced"
    level = torch.tensor([1.0 if mine else 0.0], device=device)
    _all_reduce_max(level, "the parameter-shard check")
    return not mine and bool(level.item() > 0)


def _all_reduce_max(tensor: Tensor, what: str) -> None:
    """All-reduce ``tensor`` (MAX) in place; a failure (a rank is gone: gloo
    says "Connection closed by peer", NCCL times out) is :class:`PeerGone`."""
    import torch.distributed as dist

    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    except RuntimeError as exc:  # DistBackendError is one too
        raise PeerGone(f"{what}: {exc}") from exc


def as_received(finding: Finding) -> Finding:
    """``finding`` (this rank's forward, backward…) as a value received from
    another rank's parameter shard; bad input data stays data."""
    if finding.cause in ("produced", "propagated"):
        finding.cause = "received"
        note = "another rank's parameter shard was non-finite; FSDP's all-gather brought it here"
        finding.note = f"{finding.note}; {note}" if finding.note else note
    return finding
