"""Server memory and descriptors under floods: RSS of a real ``nand server``
process before and after each flood, and whether REST still answers.

    python benchmarks/floods.py

1. 20 frames of 100 MB on the ZeroMQ port (libzmq drops them unread);
2. 200 frames of 5 MB (just over the 4 MB limit: read and counted too_large);
3. 10,000 new agent ids, one hello each, then 5,000 new runs;
4. a 200 MB JSON body POSTed to the stop endpoint without a token;
5. 400 ZeroMQ connections to a server started with a soft descriptor limit of
   256 (hard limit unchanged), then with its hard limit at 256 too:
   ``/healthz`` time and stderr bytes written.
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nand import wire  # noqa: E402
from nand.testing import free_port  # noqa: E402
from tests.server.processes import ServerProcess  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def settle(server: ServerProcess, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        httpx.get(f"{server.http_url}/healthz", timeout=10)
        time.sleep(0.2)


def send_frames(endpoint: str, frames: int, size: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.connect(endpoint)
    payload = b"\x00" * size
    for _ in range(frames):
        try:
            sock.send(payload)
        except zmq.Again:
            break
    sock.close()
    ctx.term()


def hellos(endpoint: str, agents: int, runs: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(endpoint)
    for i in range(agents):
        run = f"flood-{i % runs}" if runs else "flood"
        body = {"world_size": 1, "host": "h", "pid": i}
        message = wire.agent_message(
            "hello", agent=uuid.uuid4().hex, seq=1, run=run, rank=0, body=body
        )
        sock.send(wire.encode(message))
    time.sleep(3)
    sock.close()
    ctx.term()


def big_post(server: ServerProcess, megabytes: int) -> int:
    body = b'{"reason": "' + b"x" * (megabytes * 1024 * 1024) + b'"}'
    try:
        response = httpx.post(
            f"{server.http_url}/api/runs/x/stop",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        return response.status_code
    except httpx.HTTPError as exc:  # the server may close the connection mid-body
        return -1 if "closed" in str(exc) else -2


def connections(endpoint: str, count: int) -> list[zmq.Socket]:
    ctx = zmq.Context.instance()
    socks = []
    for _ in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    return socks


def healthz_seconds(server: ServerProcess) -> float:
    started = time.perf_counter()
    try:
        httpx.get(f"{server.http_url}/healthz", timeout=10)
    except httpx.HTTPError:
        return float("inf")
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        stderr_path = Path(tmp) / "server.err"
        with open(stderr_path, "w") as stderr:
            server = start_at_256(ServerProcess(f"sqlite:///{tmp}/nand.db", free_port()), stderr)
            try:
                run_floods(server, stderr_path)
            finally:
                server.stop()


def start_at_256(server: ServerProcess, stderr) -> ServerProcess:
    """Start the server with a soft descriptor limit of 256 (the hard one unchanged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        return server.start(stderr=stderr)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def run_floods(server: ServerProcess, stderr_path: Path) -> None:
    assert server.proc is not None
    pid = server.proc.pid
    settle(server)
    print(f"idle: {rss_mb(pid):.0f} MB")
    for name, flood in (
        ("20 x 100 MB frames", lambda: send_frames(server.zmq_endpoint, 20, 100 << 20)),
        ("200 x 5 MB frames", lambda: send_frames(server.zmq_endpoint, 200, 5 << 20)),
        ("10,000 new agent ids", lambda: hellos(server.zmq_endpoint, 10_000, 0)),
        ("5,000 new runs", lambda: hellos(server.zmq_endpoint, 5_000, 5_000)),
        ("200 MB POST /stop", lambda: print(f"  status {big_post(server, 200)}")),
    ):
        before = rss_mb(pid)
        flood()
        settle(server)
        print(f"{name}: {before:.0f} -> {rss_mb(pid):.0f} MB")
    descriptor_flood(server, stderr_path)


def descriptor_flood(server: ServerProcess, stderr_path: Path) -> None:
    """400 connections as started (soft limit 256), then with the hard limit at 256 too."""
    assert server.proc is not None
    soft = resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE)[0]
    connection_flood(server, stderr_path, f"started at soft 256, now soft {soft}")
    resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE, (256, 256))
    connection_flood(server, stderr_path, "hard limit 256")


def connection_flood(server: ServerProcess, stderr_path: Path, limit: str) -> None:
    size = os.path.getsize(stderr_path)
    socks = connections(server.zmq_endpoint, 400)
    time.sleep(3)
    seconds = [healthz_seconds(server) for _ in range(5)]
    paused = listener_paused(server)
    time.sleep(2)
    grown = os.path.getsize(stderr_path) - size
    print(
        f"400 ZeroMQ connections ({limit}): /healthz max {max(seconds) * 1000:.0f} ms, "
        f"log +{grown / 1024:.0f} KiB in ~5 s, listener paused: {paused}"
    )
    for sock in socks:
        sock.close()
    started = time.monotonic()
    while paused and listener_paused(server) and time.monotonic() - started < 30:
        time.sleep(0.1)
    if paused:
        print(f"  closed: the listener resumed after {time.monotonic() - started:.1f} s")
    time.sleep(2)


def listener_paused(server: ServerProcess) -> int:
    """``nand_agent_listener_paused`` from ``/metrics``: 1 while new agents wait."""
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("nand_agent_listener_paused "))
    return int(float(line.split()[1]))


if __name__ == "__main__":
    main()
