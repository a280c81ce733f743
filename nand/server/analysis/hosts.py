"""Repeat offenders across runs: which hosts (and GPUs) produce the incidents.

A faulty node ("a lemon") shows up as the origin of non-finite values, the
rank whose replica drifted, or the rank that crashed, in run after run,
whoever's job it was. :func:`tally` counts, over the recent runs, per host
and per GPU on it (from the rank's device, ``cuda:3`` → 3):

- ``incidents``: runs whose origin (the rank that produced the first
  non-finite value, alone: ranks that went non-finite together point at the
  model, not at a host) ran there;
- ``mismatches``: runs in which a rank there held parameters that differed
  from the other replicas' (``replica_mismatch``, ``nand.server.analysis.replicas``);
- ``crashes``: ranks there that exited with an exception.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping

from nand.server.analysis import correlate, views
from nand.server.schemas.hosts import GpuTally, HostTally
from nand.server.storage.models import Rank, Run


@dataclasses.dataclass
class Counts:
    runs: set[int] = dataclasses.field(default_factory=set)
    ranks: int = 0
    incidents: int = 0
    mismatches: int = 0
    crashes: int = 0
    last_seen: float = 0.0


def gpu_index(device: str) -> int | None:
    """``cuda:3`` → 3; None for a CPU or an unnumbered device.

    >>> gpu_index("cuda:3"), gpu_index("cpu"), gpu_index("cuda")
    (3, None, None)
    """
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def tally(runs: Iterable[Run], ranks_by_run: Mapping[int, views.RankRows]) -> list[HostTally]:
    """Hosts by incidents, then mismatches, then crashes (worst first)."""
    hosts: dict[str, Counts] = defaultdict(Counts)
    gpus: dict[tuple[str, int], Counts] = defaultdict(Counts)
    for run in runs:
        rows = ranks_by_run.get(run.id, [])
        origin = _lone_origin(rows)
        odd = set(run.replica_ranks or []) if run.replica_step is not None else set()
        for rank, _ in rows:
            places = [hosts[rank.host]]
            index = gpu_index(rank.device)
            if index is not None:
                places.append(gpus[(rank.host, index)])
            for counts in places:
                _count(counts, run, rank, rank.rank == origin, rank.rank in odd)
    found = [_host_out(host, counts, gpus) for host, counts in hosts.items() if host]
    return sorted(found, key=lambda h: (-h.incidents, -h.mismatches, -h.crashes, h.host))


def _lone_origin(rows: views.RankRows) -> int | None:
    """The rank that produced the run's first non-finite value by itself, if any."""
    firsts = [views.to_event(event) for _, event in rows if event is not None]
    head = correlate.origin(firsts)
    if head is None or len(correlate.first_ranks(firsts)) > 1 or head.cause == "received":
        return None
    return head.rank


def _count(counts: Counts, run: Run, rank: Rank, origin: bool, odd: bool) -> None:
    counts.runs.add(run.id)
    counts.ranks += 1
    counts.incidents += origin
    counts.mismatches += odd
    counts.crashes += correlate.crashed_bye(rank.bye_reason or "")
    counts.last_seen = max(counts.last_seen, rank.last_seen)


def _host_out(host: str, counts: Counts, gpus: dict[tuple[str, int], Counts]) -> HostTally:
    on_host = sorted((index, c) for (name, index), c in gpus.items() if name == host)
    return HostTally(
        host=host,
        gpus=[_figures(GpuTally(gpu=index), c) for index, c in on_host],
        **_figures(GpuTally(), counts).model_dump(exclude={"gpu"}),
    )


def _figures(out: GpuTally, counts: Counts) -> GpuTally:
    out.runs, out.ranks = len(counts.runs), counts.ranks
    out.incidents, out.mismatches, out.crashes = counts.incidents, counts.mismatches, counts.crashes
    out.last_seen = counts.last_seen
    return out
