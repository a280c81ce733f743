"""The exit codes of the ``nand`` command line, one per outcome, so scripts can act on them.

====  ==================  ======================================================
code  name                meaning
====  ==================  ======================================================
0     OK                  done (``nand wait``: the state asked for was reached)
1     ERROR               the server answered with an error (its reason is printed)
2     USAGE               bad arguments (argparse) or a bad ``--url``
3     DIVERGED            ``nand wait``: the run diverged
4     LOST                ``nand wait``: a rank was lost (silent for NAND_LOST_AFTER_S)
5     STALLED             ``nand wait``: a rank stalled (no step progress)
6     FINISHED            ``nand wait --until diverged``: it finished without diverging
7     CRASHED             ``nand wait``: a rank exited with an exception
8     UNREACHABLE         the server could not be reached (for ``--retry-for`` s)
9     NOT_FOUND           no such run, or no such file
10    BAD_ADDRESS         ``--http``/``--zmq`` is not an address that can be bound
11    ADDRESS_IN_USE      the HTTP or ZeroMQ port is taken (another server?)
12    BAD_DATABASE_URL    ``--db`` does not parse, names an unsupported database, or is in memory
13    MISSING_EXTRA       an optional dependency is not installed (the extra is named)
14    DATABASE_ERROR      the database could not be opened, created or reached
15    REPLICA_MISMATCH    ``nand wait``: a DDP rank's parameters differ from the other replicas'
124   TIMEOUT             ``--timeout`` passed first
====  ==================  ======================================================
"""

from __future__ import annotations

OK = 0
ERROR = 1
USAGE = 2
DIVERGED = 3
LOST = 4
STALLED = 5
FINISHED = 6
CRASHED = 7
UNREACHABLE = 8
NOT_FOUND = 9
BAD_ADDRESS = 10
ADDRESS_IN_USE = 11
BAD_DATABASE_URL = 12
MISSING_EXTRA = 13
DATABASE_ERROR = 14
REPLICA_MISMATCH = 15
TIMEOUT = 124
