"""One server's ingest with real agents: 8 ``ServerSink`` processes at full rate into SQLite.

    python benchmarks/agents_ingest.py                    # 8 agents, 60 s, then a 10 s count
    python benchmarks/agents_ingest.py --seconds 15 --count-seconds 5

Each agent process runs the agent's real transport (``ServerSink``: mailbox,
sender thread, DEALER socket, window of unacknowledged frames, spool) with no
torch training, as ``benchmarks/delivery.py`` does. It says hello (world size
N, as a DDP rank would) and then submits heartbeats as fast as the transport
takes them: at most ``--in-flight`` submitted and not yet acknowledged, so its
mailbox never overflows. Every heartbeat carries what a DDP rank's does
(``nand.agent.output.session``: step, loss, gradient norm, max activation,
steps/s, the AMP scale, this rank's ``local_grad_norms`` for its step) and,
with ``--dropped`` (the default), one loss counted before the hello, so the
first heartbeat carries a ``dropped`` count (an agent sends its counts when
they change: ``nand.agent.transport.server_sink``).

1. **Throughput**: a ``nand server`` process (SQLite file). After a 3 s
   warm-up, stored messages/s over ``--seconds`` from the database's count of
   the run's ``messages`` rows, and the server process's CPU time per stored
   message (/proc: what one free core could take, 1e6 / µs per message), and
   that of its busiest thread, the ingest thread (``--py-spy FILE``: sample the
   server process over the window with py-spy, ``pip install py-spy``).
   Then each agent flushes and says bye: every message must be acknowledged
   and stored, none dropped (0 lost).
2. **Count** (``--count-seconds``, 0 to skip): the same agents against the
   server run in this process (``nand.server.embedded``), counting SQL
   statements (SQLAlchemy ``before_cursor_execute``) and transactions per
   stored message, and the mean batch.

The machine these run on is shared: quote the CPU time and the counts per
message, and the load average (printed) with any wall-clock rate.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, func, select

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nand.agent.identity import Identity  # noqa: E402
from nand.agent.transport.server_sink import ServerSink  # noqa: E402
from nand.events import StepSummary  # noqa: E402
from nand.server import collector, embedded  # noqa: E402
from nand.server.storage.models import Message, Run  # noqa: E402
from nand.testing import free_port  # noqa: E402
from tests.server.processes import ServerProcess  # noqa: E402

MODULES = [
    {"name": f"layers.{i}.{part}", "type": "Linear", "order": 2 * i + j, "params": 4096}
    for i in range(12)
    for j, part in enumerate(("attn", "mlp"))
]


def summary(step: int, rank: int) -> StepSummary:
    """A DDP rank's heartbeat for one step (figures that move a little)."""
    wobble = (step % 17) / 170
    return StepSummary(
        step=step,
        steps_per_s=250.0,
        loss=2.5 - wobble,
        grad_norm=1.2 + wobble,
        max_activation=35.0 + wobble,
        amp_scale=65536.0,
        local_grad_norms=[(step, 1.0 + rank / 100 + wobble)],
    )


def agent(
    endpoint: str, run: str, rank: int, world: int, seconds: float, args: dict[str, Any], out: Any
) -> None:
    """One rank: hello, heartbeats at full rate for ``seconds``, flush, bye."""
    me = Identity(
        run=run, rank=rank, local_rank=rank, world_size=world, host="bench", pid=os.getpid()
    )
    spool = tempfile.mkdtemp(prefix="nand-bench-spool-")
    sink = ServerSink(endpoint, me, spool_dir=spool)
    if args["dropped"]:
        sink._mailbox.count_drop("queue_full")  # an earlier loss: every heartbeat says so
    sink.hello({"device": "cpu", "modules": MODULES, "optimizer": "AdamW", "on_nonfinite": "warn"})
    step, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        sender = sink._sender
        acked = sender.stats["acked"] if sender is not None else 0
        for _ in range(args["in_flight"] - (sink._seq - acked)):  # (stats() walks the window)
            step += 1
            sink.heartbeat(summary(step, rank))
        time.sleep(0.001)
    flushed = sink.flush(120)
    sink.bye(step, "done")
    sink.close(30)
    lost = {k: v for k, v in sink.dropped().items() if not (args["dropped"] and k == "queue_full")}
    if args["dropped"] and sink.dropped().get("queue_full", 0) > 1:
        lost["queue_full"] = sink.dropped()["queue_full"] - 1
    out.put((rank, sink.stats()["submitted"], flushed, lost, time.process_time()))


def stored(engine: Any, run: str) -> int:
    statement = (
        select(func.count())
        .select_from(Message)
        .join(Run, Run.id == Message.run_id)
        .where(Run.name == run)
    )
    with engine.connect() as conn:
        return int(conn.scalar(statement) or 0)


def drive(
    endpoint: str,
    db_url: str,
    opts: argparse.Namespace,
    seconds: float,
    cpu: Any,
    threads: Any = dict,
    pid: int | None = None,
) -> dict:
    """Start the agents, measure a window of ``seconds`` after the warm-up, check nothing lost."""
    run = f"bench-{uuid.uuid4().hex[:8]}"
    args = {"dropped": opts.dropped, "in_flight": opts.in_flight}
    out: mp.Queue = mp.Queue()
    total = opts.warmup + seconds
    procs = [
        mp.Process(target=agent, args=(endpoint, run, r, opts.agents, total, args, out))
        for r in range(opts.agents)
    ]
    engine = create_engine(db_url)
    for p in procs:
        p.start()
    time.sleep(opts.warmup)
    spy = _py_spy(pid, seconds, opts.py_spy) if opts.py_spy and pid else None
    n0, c0, t0, th0 = stored(engine, run), cpu(), time.monotonic(), threads()
    time.sleep(seconds)
    n1, c1, t1, th1 = stored(engine, run), cpu(), time.monotonic(), threads()
    if spy is not None:
        spy.wait()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    submitted = sum(r[1] for r in results)
    final = stored(engine, run)
    engine.dispose()
    return {
        "msg_per_s": (n1 - n0) / (t1 - t0),
        "cpu_us": 1e6 * (c1 - c0) / max(n1 - n0, 1),
        # The busiest thread's CPU per message: the ingest thread (one core at most).
        "thread_us": 1e6
        * max((th1[t] - th0.get(t, 0.0) for t in th1), default=0.0)
        / max(n1 - n0, 1),
        "window": n1 - n0,
        "submitted": submitted,
        "stored": final,
        "all_acked": all(r[2] for r in results),
        "dropped": {r[0]: r[3] for r in results if r[3]},
        # The agents' own CPU (training thread and sender) per message they sent.
        "agent_us": 1e6 * sum(r[4] for r in results) / max(submitted, 1),
    }


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of process ``pid`` (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds[int(task)] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def _py_spy(pid: int, seconds: float, path: str) -> Any:
    """Sample the server process with py-spy (``pip install py-spy``) over the window."""
    import subprocess

    command = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds))]
    command += ["--format", "raw", "--output", path, "--threads", "--nonblocking"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def report(title: str, result: dict) -> None:
    lost = result["submitted"] - result["stored"]
    print(
        f"{title}: {result['msg_per_s']:,.0f} msg/s stored, server CPU {result['cpu_us']:.1f} "
        f"us/msg, its busiest thread (ingest) {result['thread_us']:.1f} us/msg (~"
        f"{1e6 / max(result['thread_us'], 1e-9):,.0f} msg/s on one core); submitted "
        f"{result['submitted']:,}, stored {result['stored']:,}, lost {lost}, every message "
        f"acked: {result['all_acked']}, dropped by the agents: {result['dropped'] or 'none'}; "
        f"agents' CPU {result['agent_us']:.1f} us/msg"
    )


def throughput(opts: argparse.Namespace, root: Path) -> None:
    db_url = f"sqlite:///{root / 'agents.db'}"
    server = ServerProcess(db_url, free_port()).start()
    try:
        assert server.proc is not None
        pid = server.proc.pid
        result = drive(
            server.zmq_endpoint,
            db_url,
            opts,
            opts.seconds,
            server.cpu_seconds,
            lambda: thread_cpu(pid),
            pid,
        )
    finally:
        server.stop()
    report(f"nand server process, {opts.agents} agents, {opts.seconds:g} s", result)


def count(opts: argparse.Namespace, root: Path) -> None:
    """SQL statements and transactions per stored message, the server in this process."""
    db_url = f"sqlite:///{root / 'count.db'}"
    server = embedded.start(db_url, zmq_endpoint=f"tcp://127.0.0.1:{free_port()}")
    collector.spare_long_lived()  # as `nand server` does
    engine = server.app.state.nand.engine
    ingest = server.app.state.nand.ingest
    counts = {"statements": 0, "commits": 0}

    def on_statement(*_: Any) -> None:
        if ingest._thread is not None and ingest._thread.ident == _thread_id():
            counts["statements"] += 1

    def on_commit(*_: Any) -> None:
        if ingest._thread is not None and ingest._thread.ident == _thread_id():
            counts["commits"] += 1

    if opts.profile:
        _profile(ingest, opts.profile)
    event.listen(engine, "before_cursor_execute", on_statement)
    event.listen(engine, "commit", on_commit)
    marks: list[tuple[int, int]] = []

    def cpu() -> float:  # (the counts are what matters here: mark them with the window)
        marks.append((counts["statements"], counts["commits"]))
        return time.process_time()

    try:
        result = drive(server.zmq_endpoint, db_url, opts, opts.count_seconds, cpu)
    finally:
        server.stop()
    (s0, k0), (s1, k1) = marks
    n = max(result["window"], 1)
    print(
        f"count (server in process, {opts.count_seconds:g} s): {(s1 - s0) / n:.3f} SQL "
        f"statements/msg, {(k1 - k0) / n:.4f} transactions/msg (mean batch "
        f"{n / max(k1 - k0, 1):,.0f} messages, {(s1 - s0) / max(k1 - k0, 1):.1f} statements/batch)"
    )


def _profile(ingest: Any, path: str) -> None:
    """cProfile the ingest thread's batches (receive to ack) into ``path``."""
    import atexit
    import cProfile

    profiler = cProfile.Profile()
    handle = ingest._handle

    def profiled(sock: Any, frames: Any) -> None:
        profiler.enable()
        try:
            handle(sock, frames)
        finally:
            profiler.disable()

    ingest._handle = profiled
    atexit.register(profiler.dump_stats, path)


def _thread_id() -> int:
    import threading

    return threading.get_ident()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--count-seconds", type=float, default=10.0)
    parser.add_argument("--in-flight", type=int, default=2000, help="per agent, unacknowledged")
    parser.add_argument("--profile", help="count phase: cProfile the ingest thread into this file")
    parser.add_argument("--py-spy", help="throughput phase: py-spy the server into this file")
    parser.add_argument("--no-dropped", dest="dropped", action="store_false")
    opts = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        if opts.seconds > 0:
            throughput(opts, Path(tmp))
        if opts.count_seconds > 0:
            count(opts, Path(tmp))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
