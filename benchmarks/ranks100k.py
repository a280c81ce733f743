"""100,000 ranks: ingest over 1-3 servers on one PostgreSQL, event → verdict, and
the reads of a 100,000-rank run (verdict, run page, /ranks, /series).

    python benchmarks/ranks100k.py ingest --servers 1,2,3 --ranks 20000 --seconds 30
    python benchmarks/ranks100k.py latency --ranks 1000,20000 --probes 20 [--servers 2]
    python benchmarks/ranks100k.py latency --ranks 20000,100000 --probes 10 --db sqlite
    python benchmarks/ranks100k.py reads --ranks 20000 --copies 5   # a 100,000-rank run

``ingest``: a throwaway PostgreSQL (``tests/server/pg.py``), N ``nand server``
processes on it, ``benchmarks/loadgen.py`` with ``--procs`` processes of
simulated ranks spread over the servers, heartbeats as fast as the servers
acknowledge (``--heartbeat-s 0``): stored msg/s, and each server's peak RSS.

``latency``: ``--servers`` servers on one PostgreSQL (or one on SQLite:
``--db sqlite``), a job of N simulated ranks at the heartbeat period of
``nand.cadence`` spread over them; every second a fresh rank sends a NaN
earlier than the last, and the verdict (from the first server) is polled
until it names it: p50/p99.

``reads``: ``--ranks`` ranks through the real ingest (``write_batch``: hello,
two heartbeats, a third of them a received NaN, one produced), then the run's
rows copied ``--copies`` times under new rank numbers in SQL (the ingest of
100,000 hellos takes longer than this machine can spare; the run's tally
follows the copy through the same triggers); one server on that SQLite file;
each endpoint timed over HTTP, median of 5. Then, on a copy of the file, the
first verdict after one new event, median of 5 (each a rank without one so
far, written by ``write_batch`` while the server runs): a received NaN (the
NaN spreads: the server's kept relations catch up) and a NaN a step earlier
than the origin (the origin moves: every diverged rank is classified again).
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO

import httpx
from sqlalchemy import create_engine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from nand import wire  # noqa: E402
from nand.server.agents.writer import write_batch  # noqa: E402
from nand.server.storage import migrate  # noqa: E402
from nand.testing import free_port  # noqa: E402
from tests.server import pg  # noqa: E402
from tests.server.processes import ServerProcess  # noqa: E402

ALIVE = {"NAND_LOST_AFTER_S": "1e9", "NAND_STALLED_AFTER_S": "1e9"}
#: Every rank silent for longer than this (stretched for the world size): lost.
LOST = {"NAND_LOST_AFTER_S": "0.001", "NAND_STALLED_AFTER_S": "0.001"}


def peak_rss_mb(server: ServerProcess) -> float:
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def ingest(args: argparse.Namespace) -> None:
    cluster = pg.start_cluster()
    try:
        for count in [int(n) for n in args.servers.split(",")]:
            with cluster.database() as url:
                servers = [ServerProcess(url, free_port()).start() for _ in range(count)]
                try:
                    plan = loadgen.Plan(
                        run="flood",
                        world=args.ranks,
                        servers=tuple(s.zmq_endpoint for s in servers),
                        seconds=args.seconds,
                        heartbeat_s=args.heartbeat_s,
                        fingerprint_every=0,
                    )
                    result = loadgen.summarise(loadgen.run(plan, args.procs))
                    rss = ", ".join(f"{peak_rss_mb(s):.0f}" for s in servers)
                    print(
                        f"{count} server(s), {args.ranks:,} ranks: {result['msg_per_s']:,.0f} "
                        f"msg/s stored ({result['acked']:,} acked, {result['rejected']} rejected, "
                        f"{result['unacked']} unacked, {result['seconds']:.0f} s); "
                        f"peak RSS MB: {rss}",
                        flush=True,
                    )
                finally:
                    for server in servers:
                        server.stop()
    finally:
        cluster.stop()


def latency(args: argparse.Namespace) -> None:
    if args.servers > 1 and args.db == "sqlite":
        raise SystemExit("several servers share a PostgreSQL, not an SQLite file")
    with _databases(args.db) as fresh, tempfile.TemporaryFile("w+") as log:
        for world in [int(n) for n in args.ranks.split(",")]:
            with fresh() as url:
                servers = [
                    ServerProcess(url, free_port(), **ALIVE).start(stderr=log)
                    for _ in range(args.servers)
                ]
                try:
                    label = f"[{args.db}, {args.servers} server(s)]"
                    print(f"{label} {_latency_at(servers, world, args)}", flush=True)
                    for server in servers:
                        _say_if_gone(server, log)
                finally:
                    for server in servers:
                        server.stop()


def _say_if_gone(server: ServerProcess, log: IO[str]) -> None:
    """A server that exited during the run (its peak RSS then reads 0): why, from its log."""
    assert server.proc is not None
    if server.proc.poll() is None:
        return
    log.seek(0)
    tail = log.read()[-2_000:]
    print(f"the server exited with {server.proc.returncode} during the run:\n{tail}", flush=True)


@contextmanager
def _databases(kind: str) -> Iterator[Callable[[], AbstractContextManager[str]]]:
    """Fresh empty databases of ``kind``: a throwaway PostgreSQL's, or SQLite files."""
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            made = iter(range(1_000))

            @contextmanager
            def sqlite_file() -> Iterator[str]:
                yield f"sqlite:///{tmp}/nand{next(made)}.db"

            yield sqlite_file
        return
    cluster = pg.start_cluster()
    try:
        yield cluster.database
    finally:
        cluster.stop()


def _latency_at(servers: list[ServerProcess], world: int, args: argparse.Namespace) -> str:
    plan = loadgen.Plan(
        run=f"lat{world}",
        world=world,
        servers=tuple(s.zmq_endpoint for s in servers),
        seconds=args.probe_at + args.probes + 5,
        probes=args.probes,
        probe_at=args.probe_at,
        probe_every=1.0,
    )
    tallies: list[dict] = []
    sender = threading.Thread(target=lambda: tallies.extend(loadgen.run(plan, args.procs)))
    sender.start()
    seen, origins = _watch_probes(servers[0], plan, sender)
    sender.join()
    verdict = httpx.get(f"{servers[0].http_url}/api/runs/{plan.run}/verdict", timeout=60).json()
    final = loadgen.PROBE_STEP - (verdict.get("origin") or {}).get("step", loadgen.PROBE_STEP + 1)
    sent = {int(i): t for tally in tallies for i, t in tally["probes_sent"].items()}
    left = {int(i): t for tally in tallies for i, t in tally["probes_left"].items()}
    waits = sorted(seen[i] - sent[i] for i in sent if i in seen)
    if not waits:
        return f"{world:,} ranks: no probe seen ({len(sent)}/{plan.probes} sent)"
    # (the same from when each probe left the load generator's shared window)
    after_window = sorted(seen[i] - left[i] for i in left if i in seen)
    # The last probe has the earliest step: once every probe is in, it is the origin.
    last = "the last one at the end" if final == plan.probes - 1 else "NOT the last one at the end"
    named = len(origins & set(seen))
    return (
        f"{world:,} ranks: event -> verdict {_p50_p99(waits)} ({len(waits)}/{plan.probes} "
        f"probes in it, {named} named as its origin, {last}; {len(sent)} sent on schedule); "
        f"from leaving the shared window {_p50_p99(after_window)}; peak RSS MB "
        + ", ".join(f"{peak_rss_mb(s):.0f}" for s in servers)
    )


def _p50_p99(seconds: list[float]) -> str:
    p99 = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]
    return f"p50 {1000 * statistics.median(seconds):.0f} ms, p99 {1000 * p99:.0f} ms"


def _watch_probes(
    server: ServerProcess, plan: loadgen.Plan, sender: threading.Thread
) -> tuple[dict[int, float], set[int]]:
    """When the verdict first listed each probe's rank among the ranks affected,
    and the probes it named as the origin (probe i is at PROBE_STEP - i; one
    stored after a later, earlier-step probe is affected but never the origin),
    until every probe is in or 60 s after the sender is done (a load
    generator behind schedule sends fewer probes than planned)."""
    client = httpx.Client(base_url=server.http_url, timeout=60)
    probe_of_rank = {plan.probe_rank(i): i for i in range(plan.probes)}
    seen: dict[int, float] = {}
    origins: set[int] = set()
    deadline = float("inf")
    while len(seen) < plan.probes and time.time() < deadline:
        if deadline == float("inf") and not sender.is_alive():
            deadline = time.time() + 60
        response = client.get(f"/api/runs/{plan.run}/verdict")
        if response.status_code == 200:
            now, verdict = time.time(), response.json()
            for rank in verdict["ranks_affected"]:
                if rank in probe_of_rank:
                    seen.setdefault(probe_of_rank[rank], now)
            if origin := verdict.get("origin"):
                origins.add(loadgen.PROBE_STEP - origin["step"])
        time.sleep(0.02)
    client.close()
    return seen, origins


def _messages(plan: loadgen.Plan, rank: int) -> list[dict]:
    def message(kind: str, seq: int, body: dict) -> dict:
        who = {"agent": f"a{rank}", "seq": seq, "run": plan.run, "rank": rank}
        return wire.decode(wire.encode(wire.agent_message(kind, **who, body=body)))

    out = [message("hello", 1, loadgen.hello(plan, rank))]
    out += [message("heartbeat", 1 + s, {"step": s, "loss": 2.0, "grad_norm": 1.0}) for s in (1, 2)]
    if rank == 4321 % plan.world:
        out.append(message("event", 4, loadgen.nan_event(plan, rank, 500, produced=True)))
    elif rank % 3:
        out.append(message("event", 4, loadgen.nan_event(plan, rank, 501, produced=False)))
    return out


def populate(path: Path, ranks: int, copies: int) -> None:
    engine = create_engine(f"sqlite:///{path}")
    migrate.upgrade(engine)
    plan = loadgen.Plan(run="wide", world=ranks, servers=(), seconds=0)
    batch: list[dict] = []
    for rank in range(ranks):
        batch += _messages(plan, rank)
        if len(batch) >= 2000 or rank == ranks - 1:
            write_batch(engine, batch, time.time())
            batch = []
    engine.dispose()
    _copy(path, ranks, copies)


def _copy(path: Path, ranks: int, copies: int) -> None:
    """The run's rank rows, first events and heartbeats again under ranks + k * ranks.

    The run's tally (``run_tallies``) follows by itself: the triggers that keep it
    fire on these inserts and updates as on the ingest's (migration 0013)."""
    db = sqlite3.connect(path)
    (run_id,) = db.execute("select id from runs where name = 'wide'").fetchone()
    for k in range(1, copies):
        for table in ("events", "heartbeats", "ranks"):
            columns = [r[1] for r in db.execute(f"pragma table_info({table})") if r[1] != "id"]
            values = [
                f"rank + {k * ranks}" if c == "rank" else "NULL" if c == "first_event_id" else c
                for c in columns
            ]
            db.execute(
                f"insert into {table} ({', '.join(columns)}) select {', '.join(values)} "
                f"from {table} where run_id = ? and rank < ?",
                (run_id, ranks),
            )
    db.execute(
        "update ranks set first_event_id = (select min(e.id) from events e where "
        "e.run_id = ranks.run_id and e.rank = ranks.rank) where run_id = ? and rank >= ? "
        "and first_step is not null",
        (run_id, ranks),
    )
    db.execute("update runs set world_size = ? where id = ?", (ranks * copies, run_id))
    db.commit()
    db.close()


def reads(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.db or f"{tmp}/nand.db")
        if not path.exists():
            populate(path, args.ranks, args.copies)
        for label, env in (("alive", ALIVE), ("every rank lost", LOST)):
            server = ServerProcess(f"sqlite:///{path}", free_port(), **env).start()
            try:
                _time_reads(server, label)
            finally:
                server.stop()
        shutil.copy(path, f"{tmp}/events.db")
        server = ServerProcess(f"sqlite:///{tmp}/events.db", free_port(), **ALIVE).start()
        try:
            _time_new_events(server, Path(f"{tmp}/events.db"), args.ranks, args.copies)
        finally:
            server.stop()


def _time_reads(server: ServerProcess, label: str) -> None:
    client = httpx.Client(base_url=server.http_url, timeout=300)
    paths = {
        "verdict": "/api/runs/wide/verdict",
        "run page (detail)": "/api/runs/wide",
        "/ranks first page": "/api/runs/wide/ranks",
        "/ranks page after 50,000": "/api/runs/wide/ranks?after=50000",
        "/series (1,000 ranks)": "/api/runs/wide/series",
    }
    for name, url in paths.items():
        times, size = [], 0
        for _ in range(5):
            started = time.perf_counter()
            response = client.get(url)
            times.append(time.perf_counter() - started)
            response.raise_for_status()
            size = len(response.content)
        print(
            f"[{label}] {name}: {1000 * statistics.median(times):.0f} ms, {size / 1e3:.0f} kB",
            flush=True,
        )
    print(f"[{label}] server peak RSS {peak_rss_mb(server):.0f} MB", flush=True)
    client.close()


def _time_new_events(server: ServerProcess, path: Path, ranks: int, copies: int) -> None:
    """The first verdict after one new event of a rank that had none (rank % 3 == 0,
    see :func:`_messages`): a received NaN, then NaNs each a step before the origin."""
    client = httpx.Client(base_url=server.http_url, timeout=300)
    engine = create_engine(f"sqlite:///{path}")
    plan = loadgen.Plan(run="wide", world=ranks * copies, servers=(), seconds=0)
    quiet = iter(r for r in range(3, ranks, 3) if r != 4321 % ranks)
    kinds = {
        "received NaN": lambda rank, _: loadgen.nan_event(plan, rank, 501, produced=False),
        "NaN a step before the origin (it moves)": lambda rank, i: loadgen.nan_event(
            plan, rank, 499 - i, produced=True
        ),
    }
    for name, event in kinds.items():
        times = []
        for i in range(5):
            client.get("/api/runs/wide/verdict").raise_for_status()  # (polled between events)
            rank = next(quiet)
            who = {"agent": f"a{rank}", "seq": 10, "run": plan.run, "rank": rank}
            message = wire.agent_message("event", **who, body=event(rank, i))
            write_batch(engine, [wire.decode(wire.encode(message))], time.time())
            started = time.perf_counter()
            found = client.get("/api/runs/wide/verdict").raise_for_status().json()
            times.append(time.perf_counter() - started)
            assert rank in found["ranks_affected"], rank
        print(
            f"[new event] first verdict after one {name}: "
            f"{1000 * statistics.median(times):.0f} ms (median of 5, "
            f"{', '.join(f'{1000 * t:.0f}' for t in times)})",
            flush=True,
        )
    engine.dispose()
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("ingest")
    one.add_argument("--servers", default="1,2,3")
    one.add_argument("--ranks", type=int, default=20_000)
    one.add_argument("--seconds", type=float, default=30.0)
    one.add_argument("--procs", type=int, default=2)
    one.add_argument("--heartbeat-s", type=float, default=0.0, help="0: as fast as acked")
    two = sub.add_parser("latency")
    two.add_argument("--ranks", default="1000,20000")
    two.add_argument("--probes", type=int, default=20)
    two.add_argument("--probe-at", type=float, default=10.0)
    two.add_argument("--procs", type=int, default=2)
    two.add_argument("--db", choices=("postgresql", "sqlite"), default="postgresql")
    two.add_argument("--servers", type=int, default=1, help="on one PostgreSQL")
    three = sub.add_parser("reads")
    three.add_argument("--ranks", type=int, default=20_000)
    three.add_argument("--copies", type=int, default=5)
    three.add_argument("--db", help="an SQLite file made by an earlier run (kept)")
    args = parser.parse_args()
    {"ingest": ingest, "latency": latency, "reads": reads}[args.what](args)


if __name__ == "__main__":
    main()
