"""What the ranks agree on at a step boundary, through small all-reduces.

Each rank reads its own window. When the ranks must take one decision
(``skip``/``stop``), or when FSDP shares every rank's parameter shard with
all the others, one rank's window is not enough:

- :func:`with_agreed_flag`: the 0-d "anything non-finite here" flag,
  all-reduced (MAX) on the device every step and appended to the window, so
  it rides along in the step's one host read.
- :func:`settle_shards`: only once something was non-finite on some rank
  (every rank knows it from the flag, so every rank takes part), one
  all-reduce of two figures. Did another rank find its own parameter (or
  optimizer state) shard non-finite, while this rank's were finite? Under
  FSDP that shard was all-gathered into every rank's forward, so what this
  rank saw there it received; it did not produce it. And, where a rank's
  finding is the model's own output (the light mode's, which names no
  module), the index of its first non-finite parameter shard in the
  optimizer's order (the same on every rank): with the first of any rank
  agreed, the light event is the full mode's without a replay (which would
  all-gather with the others): the rank that holds the shard reports that
  parameter, ``produced``; the others the forward of its module, ``received``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from nand.agent.detect.param_cache import ParamCache, usable
from nand.agent.detect.probes import local
from nand.agent.detect.zero import settle_zero
from nand.agent.safety import PeerGone
from nand.agent.step.analysis import ParamSource, param_finding
from nand.agent.step.finding import Finding
from nand.agent.step.losses import nonfinite_flag
from nand.events import VIA_FSDP_ALL_GATHER

#: A rank's own finding that FSDP's parameter all-gather carries to the others.
SHARD_PHASES = ("param", "optimizer_state")
#: Said in a light event named by the agreed shard.
NAMED_BY_SHARD = "named by the parameter shard the ranks found non-finite (not replayed)"


def with_agreed_flag(
    gathered: Tensor | None, n_extras: int, device: torch.device, n_losses: int = 0
) -> Tensor:
    """``gathered`` and, last, the flag all-reduced over the ranks (1: some
    rank's window held a non-finite value). The extras (AMP scale…) do not
    count, they are not findings, except the last ``n_losses``: the losses."""
    if gathered is None:
        flag = torch.zeros(1, device=device)
        gathered = torch.zeros(0, device=device)
    else:
        flag = nonfinite_flag(gathered, n_extras, n_losses).reshape(1)
    _all_reduce_max(flag, "the agreed non-finite flag")
    return torch.cat([gathered, flag.to(gathered.device)])


def settle(
    finding: Finding | None,
    source: ParamSource | None,
    micro: int,
    device: torch.device,
    gathered: bool,
) -> Finding | None:
    """This rank's finding, settled against the sharded optimizer's partition
    (ZeRO: no collective, see ``detect.zero``) and, where every rank must take
    part (``gathered``: FSDP, something non-finite on some rank), the others'
    parameter shards (:func:`settle_shards`)."""
    finding = settle_zero(finding, source if isinstance(source, ParamCache) else None)
    return settle_shards(finding, source, micro, device) if gathered else finding


def settle_shards(
    finding: Finding | None, source: ParamSource | None, micro: int, device: torch.device
) -> Finding | None:
    """This rank's finding, settled with the others (see the module). Every
    rank must call it at the same boundary (after an agreed flag said
    something was non-finite on some rank)."""
    mine = finding is not None and finding.phase in SHARD_PHASES and finding.cause == "produced"
    cache = source if isinstance(source, ParamCache) else None
    params = [p for p in cache.params() if usable(p)] if cache is not None else []
    unnamed = finding is not None and finding.phase == "forward" and not finding.module
    # The owner says which shard too, whether it named it itself (a parameter
    # found behind its forward) or not: the others name its module from it.
    owner = mine and finding is not None and finding.phase == "param"
    own = _first_bad(params) if unnamed or owner else len(params)
    figures = torch.tensor([1.0 if mine else 0.0, -float(own)], device=device)
    _all_reduce_max(figures, "the parameter-shard check")
    someone_made_it, first = figures[0].item() > 0, int(-figures[1].item())
    if mine or finding is None:
        return finding
    if unnamed and cache is not None and first < len(params):
        if own == first:
            return _param_finding(cache, params[first], micro)
        return as_received(_at_owner(finding, cache, params[first]))
    return as_received(finding) if someone_made_it else finding


def _first_bad(params: list[Tensor]) -> int:
    """The index of the first non-finite local shard (``len`` if none): one
    multi-tensor max |x| and one read, on a step already non-finite."""
    held = [(i, local(p)) for i, p in enumerate(params)]
    held = [(i, shard) for i, shard in held if shard.numel()]  # (a rank may hold none)
    if not held:
        return len(params)
    peaks = torch._foreach_norm([shard for _, shard in held], math.inf)
    bad = (~torch.isfinite(torch.stack([peak.float() for peak in peaks]))).nonzero()
    return held[int(bad[0, 0].item())][0] if bad.numel() else len(params)


def _param_finding(cache: ParamCache, p: Tensor, micro: int) -> Finding:
    return param_finding(cache.param_site(p), p, micro, NAMED_BY_SHARD)


def _at_owner(finding: Finding, cache: ParamCache, p: Tensor) -> Finding:
    """``finding`` (the model's output) moved to the module that owns ``p``."""
    site = cache.param_site(p)
    note = f"{finding.note}; {NAMED_BY_SHARD}" if finding.note else NAMED_BY_SHARD
    owner = site.module.rpartition(".")[0]
    return dataclasses.replace(finding, module=owner, module_type=site.module_type, note=note)


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
        finding.cause, finding.via = "received", VIA_FSDP_ALL_GATHER
        note = "another rank's parameter shard was non-finite; FSDP's all-gather brought it here"
        finding.note = f"{finding.note}; {note}" if finding.note else note
    return finding
