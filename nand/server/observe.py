"""Many observations into one Prometheus histogram at once.

``prometheus_client`` observes one value a call (a lock, a sum and a bucket
increment each); the ingest loop has one value per message (its lag), a
couple of thousand a batch at full rate. :func:`observe_all` counts them into
the histogram's buckets first and increments each bucket once, with the same
result as observing each (``tests/server/test_ingest_fast_paths.py`` holds the two
to it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence

from prometheus_client import Histogram


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(a)`` for each of ``amounts`` (an unlabelled histogram)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # another prometheus_client
        for amount in amounts:
            histogram.observe(amount)
        return
    if not amounts:
        return
    # Histogram.observe counts a value in the first bucket whose bound is >= it.
    for index, n in Counter(bisect_left(bounds, amount) for amount in amounts).items():
        buckets[index].inc(n)
    total.inc(sum(amounts))
