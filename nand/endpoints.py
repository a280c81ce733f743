"""Lists of servers: ``NAND_SERVER`` for the agents, ``NAND_URL`` / ``--url`` for the CLI.

Several ``nand server`` processes may share one PostgreSQL; each agent then
reports to one of them and the CLI may ask any of them. Both settings take a
list, separated by commas or spaces::

    NAND_SERVER="tcp://nand-a:5557,tcp://nand-b:5557,tcp://nand-c:5557"
    nand wait "$RUN" --url "http://nand-a:8080 http://nand-b:8080"

A rank starts at the server ``rank % len(list)`` (so the ranks spread evenly)
and moves to the next in its own order (:func:`order_for_rank`) when its
connection is judged dead (:mod:`nand.agent.transport.failover`). One address
(a single server, or a TCP load balancer in front of several) is a list of one.

>>> agent_endpoints("tcp://a:5557, tcp://b:5557")
['tcp://a:5557', 'tcp://b:5557']
"""

from __future__ import annotations

import re

from nand.errors import ConfigError

_ENDPOINT = re.compile(r"^(tcp|ipc|inproc|ws|wss)://.+")


def split_list(text: str | None) -> list[str]:
    """``"a, b  c,,"`` → ``["a", "b", "c"]``: commas and whitespace separate."""
    return [part for part in re.split(r"[\s,]+", text or "") if part]


def agent_endpoints(text: str) -> list[str]:
    """The ZeroMQ endpoints in ``text``; :class:`ConfigError` naming a bad one."""
    endpoints = split_list(text)
    if not endpoints:
        raise ConfigError(f"server endpoint {text!r} is empty; use tcp://host:port")
    for endpoint in endpoints:
        if not _ENDPOINT.match(endpoint):
            raise ConfigError(f"server endpoint {endpoint!r} is not like tcp://host:port")
    return endpoints


def order_for_rank(rank: int, count: int) -> list[int]:
    """The servers (indices) a rank tries, in turn: its own first (``rank % count``,
    consecutive ranks on different servers), then all the others, rotated by rank
    so that the ranks of a server that dies spread over the rest instead of all
    landing on the next one.

    >>> [order_for_rank(rank, 3) for rank in (0, 3, 6, 1)]
    [[0, 1, 2], [0, 2, 1], [0, 1, 2], [1, 2, 0]]
    """
    first = rank % count
    others = [first + k for k in range(1, count)]
    turn = (rank // count) % len(others) if others else 0
    return [first] + [i % count for i in others[turn:] + others[:turn]]
