"""The largest integer each kind of column holds, so every number that reaches
the store (a wire message, a REST request) is checked against it first.

``Integer`` columns are 32-bit in PostgreSQL (``INTEGER``); SQLite holds 64 bits
in any integer column, so the tighter bound is the one both databases keep.
``BigInteger`` columns are 64-bit signed (PostgreSQL ``BIGINT``, SQLite's
``INTEGER``). A value past them would raise in the driver (``OverflowError``,
``NumericValueOutOfRange``) and answer a 500 instead of saying what was wrong.

>>> INT32, INT64
(2147483647, 9223372036854775807)
"""

from __future__ import annotations

#: The largest value of an ``Integer`` column: steps, ranks, pids, offsets.
INT32 = 2**31 - 1
#: The largest value of a ``BigInteger`` column: sequence numbers, counts.
INT64 = 2**63 - 1
