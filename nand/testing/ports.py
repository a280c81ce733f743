"""Free loopback ports for tests and benchmarks that start servers and receivers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (free when asked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_endpoint() -> str:
    """A ZeroMQ endpoint on such a port: for an agent pointed at no server yet."""
    return f"tcp://127.0.0.1:{free_port()}"
