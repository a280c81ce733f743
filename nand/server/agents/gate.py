"""New agent connections wait while descriptors run short, so REST keeps answering.

Every ZeroMQ connection holds a file descriptor, and libzmq accepts every
connection it can: with fewer descriptors than agents (a hard limit of 256,
400 agents) the agents take the last one, and uvicorn can no longer accept
an HTTP request (``/healthz``, the verdict a scheduler asks for).

:class:`Gate` keeps :func:`reserve` descriptors for everything else. While
fewer than that plus the listen backlog are free, it *pauses* the ingest
socket's listener: a classic BPF filter on the listening socket drops
incoming SYNs (connection requests), so libzmq has nothing new to accept;
what was already queued (at most the backlog) still comes in. Connections
already established are untouched (their packets are not SYNs). A waiting
agent's TCP stack retries its SYN and libzmq reconnects after that, its
messages kept in memory and spool meanwhile: nothing is lost, and no agent
is ever refused (libzmq does not reconnect after a refused handshake, so
the hook ZeroMQ offers for refusing, ZAP, would strand it). Once another
reserve's worth is free, the filter comes off.

One warning a minute says when the listener pauses, with the figures;
``/metrics`` shows ``nand_agent_listener_paused``. Descriptors are counted
in ``/proc/self/fd`` (Linux; elsewhere nothing is paused), every 0.1 s while
fewer than 4,096 are free and every second otherwise (a count costs about a
microsecond per open descriptor).
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable

import zmq

log = logging.getLogger("nand.server.agents.ingest")

_PROC_FD = "/proc/self/fd"
_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27  # Linux <asm-generic/socket.h>


def reserve(limit: int) -> int:
    """Descriptors kept free of agent connections: an eighth of the limit,
    between 32 (HTTP requests, the database, logs) and 1024.

    >>> reserve(256), reserve(1024), reserve(1 << 20)
    (32, 128, 1024)
    """
    return min(1024, max(32, limit // 8))


def descriptor_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # (it may change while we run)


def free_descriptors() -> int | None:
    """Descriptors this process may still open, or None where they cannot be counted."""
    try:
        in_use = len(os.listdir(_PROC_FD)) - 1  # (listing it opens one)
    except FileNotFoundError:
        return None
    except OSError:  # EMFILE: not even one to list them with
        return 0
    return max(0, descriptor_limit() - in_use)


def _syn_filter() -> tuple[bytes, ctypes.Array[ctypes.c_char]]:
    """A ``struct sock_fprog`` that drops TCP segments with SYN set and ACK
    clear (new connection requests) and keeps every other one. A socket
    filter on a TCP socket sees the TCP header first; byte 13 holds the flags."""

    def insn(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    program = ctypes.create_string_buffer(
        insn(0x30, 0, 0, 13)  # ldb [13]: the flags
        + insn(0x54, 0, 0, 0x12)  # and #(SYN|ACK)
        + insn(0x15, 0, 1, 0x02)  # jeq #SYN: a bare SYN?
        + insn(0x06, 0, 0, 0)  # ret #0: dropped
        + insn(0x06, 0, 0, 0xFFFFFFFF)  # ret #-1: kept whole
    )
    return struct.pack("HL", 5, ctypes.addressof(program)), program  # (keep it alive)


def listening_socket(port: int) -> socket.socket | None:
    """This process's listening TCP socket on ``port`` (libzmq's, for an
    endpoint it bound), as a socket object over a duplicate descriptor.

    Only sockets are duplicated: closing a duplicate of a *file* descriptor
    would drop every POSIX lock this process holds on that file, SQLite's on
    its database among them (another process could then delete the WAL under
    the server's feet)."""
    for name in os.listdir(_PROC_FD):
        try:
            if not os.readlink(f"{_PROC_FD}/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # not a socket after all
            os.close(dup)
            continue
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            if listening and sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == port:
                return sock
        except (OSError, IndexError, TypeError):  # not an IP socket
            pass
        sock.close()
    return None


class Gate:
    """Pauses the agents' listener while descriptors run short (see the module
    docstring). :meth:`watch` the endpoint once the ingest socket has bound it."""

    def __init__(self, backlog: int, on_pause: Callable[[bool], None]) -> None:
        self.backlog = backlog
        self._on_pause = on_pause
        self._listener: socket.socket | None = None
        self._accepted: zmq.Socket | None = None
        self._paused = False
        self._last_warning = -60.0
        self._pauses = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nand-gate", daemon=True)

    def watch(self, endpoint: str, accepted: zmq.Socket | None = None) -> None:
        """Find the listener of ``endpoint`` (``tcp://host:port``) and start.
        ``accepted``: the ingest socket's monitor, reporting each connection it
        accepts, so that a burst of them is looked at as it comes, not 0.1 s on."""
        self._accepted = accepted
        if not endpoint.startswith("tcp://") or not os.path.isdir(_PROC_FD):
            return
        try:
            self._listener = listening_socket(int(endpoint.rsplit(":", 1)[1]))
        except (OSError, ValueError) as exc:
            log.warning("descriptor gate off: the listener was not found (%s)", exc)
        if self._listener is not None:
            self._thread.start()

    def stop(self, timeout: float = 2.0, wake: Callable[[], object] | None = None) -> None:
        """``wake``: ends the monitoring of the ingest socket, which wakes the
        thread out of its wait on the monitor (a second, without it)."""
        self._stopping.set()
        if wake is not None:
            wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._accepted is not None:
            self._accepted.close(linger=0)
        if self._listener is not None:
            self._listener.close()

    def _serve(self) -> None:
        interval = 0.1
        try:
            while not self._stopping.is_set():
                self._wait(interval)
                interval = self.check()
        except Exception:  # the gate must never take the ingest down
            log.exception("descriptor gate failed; it stops watching")
        finally:
            if self._accepted is not None:
                self._accepted.close(linger=0)

    def _wait(self, seconds: float) -> None:
        """Until a connection is accepted, or ``seconds`` pass."""
        if self._accepted is None:
            self._stopping.wait(seconds)
            return
        if self._accepted.poll(int(seconds * 1000)):
            while self._accepted.poll(0):  # the whole burst, then one look
                self._accepted.recv_multipart()

    def check(self) -> float:
        """Pause or resume as the free descriptors say; the seconds until the next look."""
        free = free_descriptors()
        if free is None:
            return 1.0
        kept = reserve(descriptor_limit()) + self.backlog
        if free <= kept:
            self._pause(free)
        elif self._paused and free > kept + reserve(descriptor_limit()):
            self._resume()
        return 0.1 if free < 4096 else 1.0

    def _pause(self, free: int) -> None:
        if self._paused or self._listener is None:
            return
        program, _kept_alive = _syn_filter()
        self._listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
        self._paused, self._pauses = True, self._pauses + 1
        self._on_pause(True)
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            log.warning(
                "%d of %d file descriptors free: new agent connections wait, the rest are kept "
                "for HTTP (paused %d time(s) in the last minute); agents retry and lose nothing. "
                "Raise the limit (ulimit -n, LimitNOFILE=) to admit them all",
                free,
                descriptor_limit(),
                self._pauses,
            )
            self._last_warning, self._pauses = now, 0

    def _resume(self) -> None:
        assert self._listener is not None
        self._listener.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        self._paused = False
        self._on_pause(False)


def backlog(limit: int) -> int:
    """The ingest listener's backlog: what still comes in once it pauses.

    >>> backlog(256), backlog(1 << 20)
    (16, 100)
    """
    return min(100, max(8, limit // 16))
