"""Keep Python's cyclic garbage collector off what lives as long as the server.

At full rate the ingest thread makes thousands of short-lived objects a batch
(decoded messages, rows), so the collector runs often, and every so often it
walks *all* objects: the server's modules, SQLAlchemy's, FastAPI's.
Measured with 8 agents at full rate (``benchmarks/agents_ingest.py``): a full
collection took about 100 ms, and the collector a fifth of the ingest
thread's time. Reference counting frees a batch's objects anyway (the ingest
path makes no cycles); the collector is only for cycles.
"""

from __future__ import annotations

import gc

#: Allocations between two collections of the youngest generation (Python: 700).
YOUNG_THRESHOLD = 50_000


def spare_long_lived() -> None:
    """Call once the server has started: what exists then stays for good and is
    frozen out of the collector's walks (``gc.freeze``, after a last collection so
    no garbage is frozen), and the youngest generation is collected every
    :data:`YOUNG_THRESHOLD` allocations instead of every 700."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
