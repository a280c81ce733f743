"""The server at 20,000 ranks: ingest from new ranks, ``/ranks``, the verdict under SSE clients.

    python benchmarks/scale.py                 # ~3-5 min on a 2-core machine
    python benchmarks/scale.py --ranks 5000    # a quicker run

One ``nand server`` process on a fresh SQLite file.

1. Ingest of events from new ranks: one DEALER socket sends, for ranks 0, 1,
   2, ... of one run, each rank's first event (the same logical point on
   every rank: a NaN all ranks received through the all-reduce), under a new
   agent id per rank, keeping at most ``--window`` unacknowledged. Messages/s
   are timed over each block of 1,000 ranks; printed for the blocks that start
   at 0, 5,000, 10,000 and ``--ranks`` - 1,000 ranks already in the run.
2. ``GET /api/runs/{run}/ranks`` of that run: bytes and time (median of 5);
   with pagination, the default page and the walk over every page.
3. The verdict of a small (8-rank) run, p50/p99 of 200 sequential requests,
   with 0 and then with ``--clients`` Server-Sent-Event clients connected
   (half follow ``?run=`` as ``nand wait`` does, half the whole stream as the
   dashboard does); the server's CPU use while they are connected.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nand import wire  # noqa: E402
from nand.testing import free_port  # noqa: E402
from tests.server.processes import ServerProcess  # noqa: E402

BLOCK = 1000
RECEIVED = {
    "event": {
        "step": 100,
        "micro_step": 0,
        "phase": "grad",
        "module": "layers.3.mlp.fc2.weight",
        "module_type": "Linear",
        "order": 7,
        "cause": "received",
        "nan": 12,
        "shape": [4096, 4096],
        "dtype": "bfloat16",
    },
    "flight": None,
}


def grow(server: ServerProcess, run: str, ranks: int, window: int) -> list[float]:
    """Send one first event from each of ``ranks`` new ranks; msg/s per block of 1,000."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.zmq_endpoint)
    rates = []
    for start in range(0, ranks, BLOCK):
        began = time.perf_counter()
        count = min(BLOCK, ranks - start)
        sent = acked = 0
        while acked < count:
            while sent < count and sent - acked < window:
                rank = start + sent
                body = {**RECEIVED, "event": {**RECEIVED["event"], "world_size": ranks}}
                message = wire.agent_message(
                    "event", agent=f"{run}-{rank}", seq=1, run=run, rank=rank, body=body
                )
                sock.send(wire.encode(message))
                sent += 1
            if not sock.poll(60_000):
                raise RuntimeError(f"no ack for 60 s at rank {start + acked}")
            reply = wire.decode(sock.recv())
            if reply["kind"] == "ack":
                acked += len(reply["seqs"])
        rates.append(count / (time.perf_counter() - began))
    sock.close(linger=0)
    return rates


def ranks_endpoint(server: ServerProcess, run: str) -> dict:
    """Bytes and time of ``/ranks``: the whole list, or the first page and every page."""
    client = httpx.Client(base_url=server.http_url, timeout=120)
    url = f"/api/runs/{run}/ranks"
    times, size, body = [], 0, None
    for _ in range(5):
        started = time.perf_counter()
        response = client.get(url)
        times.append(time.perf_counter() - started)
        size, body = len(response.content), response.json()
    result = {"first_ms": 1000 * statistics.median(times), "first_bytes": size}
    if isinstance(body, dict):  # paginated: walk every page
        walks = []
        for _ in range(3):
            started, total_bytes, seen, cursor = time.perf_counter(), 0, 0, None
            while True:
                page = client.get(
                    url, params={"limit": 1000, "after": cursor} if cursor else {"limit": 1000}
                )
                total_bytes += len(page.content)
                data = page.json()
                seen += len(data["items"])
                cursor = data["next_after"]
                if cursor is None:
                    break
            walks.append(time.perf_counter() - started)
        result.update(walk_ms=1000 * statistics.median(walks), walk_bytes=total_bytes, seen=seen)
    client.close()
    return result


def small_run(server: ServerProcess, run: str) -> None:
    """An 8-rank run with one event, whose verdict is timed."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.zmq_endpoint)
    for rank in range(8):
        kind, body = ("event", RECEIVED) if rank == 3 else ("heartbeat", {"step": 100})
        sock.send(
            wire.encode(
                wire.agent_message(
                    kind, agent=f"{run}-{rank}", seq=1, run=run, rank=rank, body=body
                )
            )
        )
    for _ in range(8):
        sock.poll(10_000)
        sock.recv()
    sock.close(linger=0)


def verdict_times(server: ServerProcess, run: str, requests: int = 200) -> dict:
    """p50/p99 of sequential verdict requests; a request over 30 s ends the series."""
    client = httpx.Client(base_url=server.http_url, timeout=30)
    times = []
    try:
        client.get(f"/api/runs/{run}/verdict").raise_for_status()
        for _ in range(requests):
            started = time.perf_counter()
            client.get(f"/api/runs/{run}/verdict").raise_for_status()
            times.append(time.perf_counter() - started)
    except httpx.TimeoutException:
        times.append(float("inf"))
    client.close()
    ordered = sorted(times)
    return {
        "n": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[int(0.99 * len(ordered))],
    }


def _ms(value: float) -> str:
    return "> 30 s (timed out)" if value == float("inf") else f"{value:.1f} ms"


def _clients(url: str, run: str, count: int, ready: mp.Event, stop: mp.Event) -> None:
    async def follow(client: httpx.AsyncClient, path: str, opened: list[int]) -> None:
        async with client.stream("GET", path) as response:
            opened.append(response.status_code)
            async for _ in response.aiter_bytes():
                if stop.is_set():
                    return

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
            opened: list[int] = []
            paths = [f"/api/stream?run={run}" if i % 2 else "/api/stream" for i in range(count)]
            tasks = [asyncio.create_task(follow(client, p, opened)) for p in paths]
            while len(opened) < count:
                await asyncio.sleep(0.1)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.2)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def under_clients(server: ServerProcess, run: str, count: int) -> dict:
    ready, stop = mp.Event(), mp.Event()
    proc = mp.Process(target=_clients, args=(server.http_url, run, count, ready, stop))
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError(f"{count} stream clients did not connect in 120 s")
        time.sleep(2.0)
        cpu, started = server.cpu_seconds(), time.perf_counter()
        time.sleep(5.0)
        idle_cpu = (server.cpu_seconds() - cpu) / (time.perf_counter() - started)
        result = verdict_times(server, run)
        result["server_cpu"] = idle_cpu
        return result
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--window", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(f"sqlite:///{tmp}/nand.db", free_port()).start()
        try:
            bench(server, args)
        finally:
            server.stop()


def bench(server: ServerProcess, args: argparse.Namespace) -> None:
    small_run(server, "small")
    clients(server, args.clients, "only small runs")
    rates = grow(server, "wide", args.ranks, args.window)
    marks = sorted({0, 5000, 10000, args.ranks - BLOCK} & set(range(0, args.ranks, BLOCK)))
    for mark in marks:
        rate = rates[mark // BLOCK]
        print(f"ingest, events from new ranks, {mark:>6,} ranks in the run: {rate:,.0f} msg/s")
    r = ranks_endpoint(server, "wide")
    line = (
        f"/ranks of {args.ranks:,} ranks: {r['first_bytes'] / 1e6:.2f} MB in {r['first_ms']:.0f} ms"
    )
    if "walk_ms" in r:
        line += (
            f" (first page); every page ({r['seen']:,} ranks): "
            f"{r['walk_bytes'] / 1e6:.2f} MB in {r['walk_ms']:.0f} ms"
        )
    print(line, flush=True)
    wide = verdict_times(server, "wide", 20)
    print(f"verdict of the {args.ranks:,}-rank run, 0 stream clients: p50 {_ms(wide['p50_ms'])}")
    clients(server, args.clients, f"and the active {args.ranks:,}-rank run")


def clients(server: ServerProcess, count: int, what: str) -> None:
    """The small run's verdict with 0 and ``count`` stream clients; the server's CPU."""
    quiet = verdict_times(server, "small")
    cpu, started = server.cpu_seconds(), time.perf_counter()
    time.sleep(5.0)
    idle = (server.cpu_seconds() - cpu) / (time.perf_counter() - started)
    print(
        f"[{what}] verdict of an 8-rank run, 0 stream clients: p50 {_ms(quiet['p50_ms'])}, "
        f"p99 {_ms(quiet['p99_ms'])}; server CPU {idle:.0%}",
        flush=True,
    )
    busy = under_clients(server, "small", count)
    print(
        f"[{what}] verdict of an 8-rank run, {count} stream clients: p50 {_ms(busy['p50_ms'])}, "
        f"p99 {_ms(busy['p99_ms'])} (n={busy['n']}); server CPU while they are connected "
        f"{busy['server_cpu']:.0%}",
        flush=True,
    )


if __name__ == "__main__":
    main()
