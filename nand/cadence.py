"""How often a rank reports, by the size of its job: one rule, read by the agent
and by the server.

Every rank sends a heartbeat each ``NAND_HEARTBEAT_S`` (5 s) while its job has
at most 10,000 ranks. Beyond that the interval grows with the world size so
that the job's heartbeats together stay at :data:`JOB_HEARTBEATS_PER_S` (a
sixth of what one server stores, see ``benchmarks/README.md``): 10 s at
20,000 ranks, 50 s at 100,000. The server stretches its ``lost`` and
``stalled`` thresholds, and the agent its keepalive, by the same factor, so a
rank of a big job is not called lost for reporting at its own pace.

>>> heartbeat_s(5.0, 8), heartbeat_s(5.0, 20_000), heartbeat_s(5.0, 100_000)
(5.0, 10.0, 50.0)
>>> stretch(5.0, 100_000)
10.0
"""

from __future__ import annotations

#: The most heartbeats per second one job sends, whatever its world size.
JOB_HEARTBEATS_PER_S = 2000.0


def heartbeat_s(base_s: float, world_size: int) -> float:
    """Seconds between one rank's heartbeats in a job of ``world_size`` ranks
    (``base_s`` 0, every step, stays 0: a test's setting, not a big job's)."""
    if base_s <= 0:
        return base_s
    return max(base_s, world_size / JOB_HEARTBEATS_PER_S)


def stretch(base_s: float, world_size: int) -> float:
    """How many times slower than ``base_s`` a rank of such a job reports (>= 1)."""
    if base_s <= 0:
        return 1.0
    return heartbeat_s(base_s, world_size) / base_s
