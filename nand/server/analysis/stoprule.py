"""The step at which every rank of a run stops, when nobody names one.

Rule: ``S = L + max(MIN_MARGIN, ceil(2 * heartbeat_s * r))`` where ``L`` is
the largest step any rank has reported and ``r`` the fastest rank's steps/s.
Two heartbeat periods is the longest an agent connected to another server
can go without a message to piggyback the command on, so every rank hears of
``S`` before it gets there; :data:`MIN_MARGIN` covers runs that report no rate.

>>> stop_step([10, 12], [2.0, None], heartbeat_s=5.0)
32
>>> stop_step([7], [None], heartbeat_s=5.0)
10
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_MARGIN = 3


def stop_step(
    latest_steps: Sequence[int], steps_per_s: Sequence[float | None], heartbeat_s: float
) -> int:
    latest = max(latest_steps, default=0)
    rate = max((r for r in steps_per_s if r is not None and r > 0), default=0.0)
    return latest + max(MIN_MARGIN, math.ceil(2 * heartbeat_s * rate))
