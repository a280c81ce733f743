"""Server ingest benchmark: throughput, event-to-verdict latency, verdict query time.

    python benchmarks/ingest.py                      # SQLite, then a throwaway PostgreSQL
    python benchmarks/ingest.py --db sqlite          # one backend
    python benchmarks/ingest.py --pg-url postgresql+psycopg://user@host/db

1. Throughput: N agent processes (real DEALER sockets) send heartbeats with
   bursts of events to a ``nand server`` process, each keeping at most
   ``--window`` messages unacknowledged (as the agent's transport does);
   sustained messages/s = messages acked / (first send → last ack), and the
   server process's CPU time per message (its capacity on one free core: the
   agents run on the same machine and compete for it). Nothing
   lost: every message acked, and the database holds exactly that many.
2. Event-to-verdict: with background heartbeat load, an agent sends an event
   for a fresh run and the benchmark polls ``GET /api/runs/{run}/verdict``
   until it says ``diverged``; p50/p99 over ``--latency-samples``.
3. Verdict query: 1,000,000 events bulk-inserted into one 8-rank run, then
   ``GET /api/runs/{run}/verdict`` timed over HTTP (p50/p99).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx
import zmq
from sqlalchemy import create_engine, func, select, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nand import wire  # noqa: E402
from nand.server.storage.models import Message  # noqa: E402
from nand.testing import free_port  # noqa: E402
from tests.server.processes import ServerProcess  # noqa: E402

EVENT_BODY = {
    "event": {
        "step": 0,
        "micro_step": 0,
        "phase": "forward",
        "module": "layers.3.mlp.fc2",
        "module_type": "Linear",
        "order": 7,
        "cause": "produced",
        "nan": 12,
        "shape": [32, 4096],
        "dtype": "bfloat16",
    },
    "flight": None,
}


def _agent(endpoint: str, run: str, rank: int, count: int, window: int, out: mp.Queue) -> None:
    """One simulated agent: heartbeats, every 50th message a burst of 10 events."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    agent, acked, sent = uuid.uuid4().hex, set(), 0
    first = time.time()
    while len(acked) < count:
        while sent < count and sent - len(acked) < window:
            sent += 1
            burst = sent % 50 < 10
            body = (
                dict(EVENT_BODY, event={**EVENT_BODY["event"], "step": sent})
                if burst
                else {"step": sent, "steps_per_s": 3.0, "loss": 2.0, "grad_norm": 1.0}
            )
            kind = "event" if burst else "heartbeat"
            message = wire.agent_message(kind, agent=agent, seq=sent, run=run, rank=rank, body=body)
            sock.send(wire.encode(message))
        if not sock.poll(30_000):
            break
        reply = wire.decode(sock.recv())
        if reply["kind"] == "ack":  # the server may also ask for a flight window
            acked.update(reply["seqs"])
    out.put((sent, len(acked), first, time.time()))
    sock.close(linger=0)


def throughput(server: ServerProcess, agents: int, total: int, window: int) -> dict:
    run = f"load-{uuid.uuid4().hex[:6]}"
    out: mp.Queue = mp.Queue()
    procs = [
        mp.Process(target=_agent, args=(server.zmq_endpoint, run, r, total // agents, window, out))
        for r in range(agents)
    ]
    cpu_before = server.cpu_seconds()
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    cpu = server.cpu_seconds() - cpu_before
    for p in procs:
        p.join()
    sent = sum(r[0] for r in results)
    acked = sum(r[1] for r in results)
    seconds = max(r[3] for r in results) - min(r[2] for r in results)
    engine = create_engine(server.db_url)
    with engine.connect() as conn:
        stored = conn.scalar(
            select(func.count())
            .select_from(Message)
            .where(
                Message.run_id
                == select(text("id"))
                .select_from(text("runs"))
                .where(text("name = :n"))
                .scalar_subquery()
            ),
            {"n": run},
        )
    engine.dispose()
    return {
        "sent": sent,
        "acked": acked,
        "stored": stored,
        "seconds": seconds,
        "msg_per_s": acked / seconds,
        "cpu_us": 1e6 * cpu / max(acked, 1),
    }


def _background(endpoint: str, rate: float, stop: mp.Event) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    agent, seq, started = uuid.uuid4().hex, 0, time.time()
    while not stop.is_set():
        seq += 1
        body = {"step": seq, "steps_per_s": rate, "loss": 1.0}
        sock.send(
            wire.encode(
                wire.agent_message(
                    "heartbeat", agent=agent, seq=seq, run="background", rank=0, body=body
                )
            )
        )
        while sock.poll(0):
            sock.recv()
        pause = started + seq / rate - time.time()
        if pause > 0:
            time.sleep(pause)
    sock.close(linger=0)


def event_to_verdict(server: ServerProcess, samples: int, load: float) -> dict:
    stop = mp.Event()
    bg = mp.Process(target=_background, args=(server.zmq_endpoint, load, stop))
    bg.start()
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(server.zmq_endpoint)
    client = httpx.Client(base_url=server.http_url)
    latencies = []
    try:
        time.sleep(1.0)
        for i in range(samples):
            run = f"lat-{uuid.uuid4().hex[:8]}"
            message = wire.agent_message(
                "event", agent=run, seq=1, run=run, rank=0, body=EVENT_BODY
            )
            started = time.perf_counter()
            sock.send(wire.encode(message))
            while True:
                response = client.get(f"/api/runs/{run}/verdict")
                if response.status_code == 200 and response.json()["state"] == "diverged":
                    break
                time.sleep(0.002)
            latencies.append(time.perf_counter() - started)
            while sock.poll(0):
                sock.recv()
            del i
    finally:
        stop.set()
        bg.join(10)
        sock.close(linger=0)
        client.close()
    return _percentiles(latencies)


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def bulk_events(db_url: str, run: str, count: int, ranks: int = 8) -> None:
    """Insert ``count`` events for one run straight into the tables (setup only)."""
    engine = create_engine(db_url)
    now = time.time()
    with engine.begin() as conn:
        run_id = conn.execute(
            text(
                "INSERT INTO runs (name, world_size, started_at, last_seen, updated_at, "
                "latest_step, event_count, optimizer, stop_reason) "
                "VALUES (:n, :w, :t, :t, :t, :s, :c, '', '') "
                "RETURNING id"
            ),
            {"n": run, "w": ranks, "t": now, "s": count // ranks, "c": count},
        ).scalar_one()
        for rank in range(ranks):
            conn.execute(
                text(
                    "INSERT INTO ranks (run_id, rank, world_size, host, pid, first_seen, "
                    "last_seen, step, step_changed_at, amp_skipped, bye_reason) "
                    "VALUES (:r, :k, :w, 'h', 1, :t, :t, 0, :t, 0, '')"
                ),
                {"r": run_id, "k": rank, "w": ranks, "t": now},
            )
    columns = (
        "run_id, rank, world_size, host, pid, step, micro_step, phase, phase_rank, module, "
        "module_type, ord, cause, call, dtype, time, seq, message, shape"
    )
    phases = ["forward", "backward", "grad"]

    def row(i: int) -> tuple:
        phase = phases[i % 3]
        return (
            run_id,
            i % ranks,
            ranks,
            "h",
            1,
            1000 + i // ranks,
            0,
            phase,
            ["input", "forward", "loss", "backward", "grad"].index(phase),
            f"layers.{i % 48}.fc",
            "Linear",
            i % 97,
            "propagated",
            0,
            "bfloat16",
            now,
            i,
            "",
            "[32, 4096]",
        )

    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        if engine.dialect.name == "postgresql":
            with cursor.copy(f"COPY events ({columns}) FROM STDIN") as copy:
                for i in range(count):
                    copy.write_row(row(i))
        else:
            marks = ", ".join("?" * 19)
            for start in range(0, count, 50_000):
                cursor.executemany(
                    f"INSERT INTO events ({columns}) VALUES ({marks})",
                    [row(i) for i in range(start, min(count, start + 50_000))],
                )
        raw.commit()
    finally:
        raw.close()
    with engine.begin() as conn:  # what ingest maintains: each rank's first event
        for rank in range(ranks):
            first = conn.execute(
                text(
                    "SELECT id, step, micro_step, phase_rank, ord FROM events "
                    "WHERE run_id = :r AND rank = :k "
                    "ORDER BY step, micro_step, phase_rank, ord LIMIT 1"
                ),
                {"r": run_id, "k": rank},
            ).one()
            conn.execute(
                text(
                    "UPDATE ranks SET first_event_id = :i, first_step = :s, first_micro_step = :m, "
                    "first_phase_rank = :p, first_order = :o WHERE run_id = :r AND rank = :k"
                ),
                {
                    "i": first[0],
                    "s": first[1],
                    "m": first[2],
                    "p": first[3],
                    "o": first[4],
                    "r": run_id,
                    "k": rank,
                },
            )
        if engine.dialect.name == "postgresql":
            conn.execute(text("ANALYZE"))
    engine.dispose()


def verdict_query(server: ServerProcess, run: str, repeats: int) -> dict:
    client = httpx.Client(base_url=server.http_url)
    client.get(f"/api/runs/{run}/verdict").raise_for_status()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        client.get(f"/api/runs/{run}/verdict").raise_for_status()
        times.append(time.perf_counter() - started)
    client.close()
    return _percentiles(times)


def bench(name: str, db_url: str, args: argparse.Namespace) -> None:
    print(f"\n== {name}: {db_url.split('@')[-1]}", flush=True)
    server = ServerProcess(db_url, free_port()).start()
    try:
        t = throughput(server, args.agents, args.messages, args.window)
        lost = t["sent"] - t["acked"]
        print(
            f"throughput: {t['msg_per_s']:,.0f} msg/s ({t['acked']:,} acked of {t['sent']:,} "
            f"sent in {t['seconds']:.1f} s by {args.agents} agents; stored {t['stored']:,}; "
            f"lost {lost}); server CPU {t['cpu_us']:.0f} us/msg = "
            f"{1e6 / t['cpu_us']:,.0f} msg/s per core",
            flush=True,
        )
        lat = event_to_verdict(server, args.latency_samples, args.background_rate)
        print(
            f"event-to-verdict: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms "
            f"(n={lat['n']}, background {args.background_rate:.0f} heartbeats/s)",
            flush=True,
        )
        started = time.time()
        bulk_events(db_url, "big", args.events)
        print(
            f"setup: {args.events:,} events bulk-inserted in {time.time() - started:.0f} s",
            flush=True,
        )
        q = verdict_query(server, "big", args.repeats)
        print(
            f"verdict query, {args.events:,} stored events: p50 {q['p50_ms']:.1f} ms, "
            f"p99 {q['p99_ms']:.1f} ms (n={q['n']}, over HTTP)",
            flush=True,
        )
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--pg-url", help="use this PostgreSQL instead of a throwaway cluster")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--window", type=int, default=5_000)
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--background-rate", type=float, default=2_000.0)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--dir", default=None, help="where the SQLite file goes (default: tmp)")
    args = parser.parse_args()
    print(f"nand ingest benchmark on {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
    if args.db in ("sqlite", "both"):
        import tempfile

        folder = Path(args.dir or tempfile.mkdtemp(prefix="nand-bench-"))
        bench("SQLite", f"sqlite:///{folder / 'bench.db'}", args)
    if args.db in ("postgres", "both"):
        if args.pg_url:
            bench("PostgreSQL", args.pg_url, args)
            return
        from tests.server import pg

        cluster = pg.start_cluster()
        try:
            with cluster.database() as url:
                bench("PostgreSQL (throwaway cluster, fsync off)", url, args)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
