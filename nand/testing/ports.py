"""Free loopback ports for tests and benchmarks that start servers and receivers."""

from __future__ import annotations

import random
import socket

#: Ports handed out: below Linux's ephemeral range (32768-60999), from which the
#: kernel takes the local port of every outgoing connection. A port picked inside
#: it can be taken by some connection before the server meant to bind it is up.
PORTS = range(20_000, 32_768)
#: Not the ``random`` module's generator: tests seed that one, and two test
#: workers seeded alike would try the same ports in the same order.
_pick = random.SystemRandom()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (free when asked)."""
    for _ in range(200):
        port = _pick.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (that range all taken: let the kernel choose)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_endpoint() -> str:
    """A ZeroMQ endpoint on such a port: for an agent pointed at no server yet."""
    return f"tcp://127.0.0.1:{free_port()}"
