"""Time to cancel: from a Slurm job's first non-finite step to the job's end.

    python benchmarks/time_to_cancel.py --jobs 20          (as root, Slurm installed)
    python benchmarks/time_to_cancel.py --quick            (2 jobs: a smoke test)

Starts a one-node Slurm (tests/e2e/slurm.py: ``scripts/install-slurm`` installs
it) and a nand server (SQLite, the default heartbeat and stream poll), then
submits ``examples/slurm/train_cpu.sbatch`` ``--jobs`` times, one after the
other, each with a planted overflow on rank 1 at ``--step``, as a user does.
Its ``nand watchdog`` cancels each job; the times, all on this machine's clock:

- ``t_event``: the agent's time of the first non-finite event (the verdict's ``since``);
- ``t_server``: the first time the server's REST API says the run diverged (polled
  every 20 ms from here);
- ``t_watchdog``, ``t_scancel``, ``t_cancelled``: when the watchdog saw it, called
  ``scancel`` and had its answer (its log lines, to the millisecond);
- ``t_ranks_gone``, ``t_gone``: the training processes (torchrun's workers), then
  every process of the job that was there before the fault, have ended (polled
  every 10 ms);
- ``t_end``: ``scontrol`` says the job is ``CANCELLED`` and no longer completing.

Parts (p50 / p99 / max over the jobs): agent → server (``t_server -
t_event``), server → watchdog (``t_watchdog - t_server``), watchdog → scancel
(the verdict settled and printed, ``t_scancel - t_watchdog``), scancel → ranks
gone, scancel → every process gone (``t_gone - t_scancel``: Slurm's
``KillWait``, 5 s here and 30 s by default, when a process outlives SIGTERM, as
torchrun's launcher does), and in all, first non-finite step → job ended
(``max(t_gone, t_end) - t_event``). ``--json`` writes every job's times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nand.client import ApiError, request_json, run_url  # noqa: E402
from nand.server import embedded  # noqa: E402
from nand.server.settings import Settings  # noqa: E402
from tests.e2e import slurm  # noqa: E402

SCRIPT = REPO / "examples/slurm/train_cpu.sbatch"
TOKEN = "time-to-cancel"
WATCHDOG_LINE = re.compile(r"^nand watchdog: (\S+ \S+) (.*)$")
PARTS = (
    ("agent -> server", "t_event", "t_server"),
    ("server -> watchdog", "t_server", "t_watchdog"),
    ("watchdog -> scancel", "t_watchdog", "t_scancel"),
    ("scancel -> ranks gone", "t_scancel", "t_ranks_gone"),
    ("scancel -> processes gone", "t_scancel", "t_gone"),
    ("non-finite step -> job ended", "t_event", "t_ended"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20, help="jobs submitted, one at a time")
    parser.add_argument("--step", type=int, default=15, help="the step the fault is planted at")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds per step, at least")
    parser.add_argument("--quick", action="store_true", help="2 jobs: a smoke test")
    parser.add_argument("--json", type=Path, help="write every job's times here")
    return parser.parse_args(argv)


def job_env(server: embedded.EmbeddedServer) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "NAND_SERVER": server.zmq_endpoint,
        "NAND_URL": server.http_url,
        "NAND_TOKEN": TOKEN,
        "OMP_NUM_THREADS": "1",
    }


def summary(base: str, job: str) -> dict[str, Any] | None:
    try:
        return request_json(run_url(base, job))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def until(predicate: Any, timeout: float, interval: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)


def watch_server(base: str, job: str, times: dict[str, float], done: threading.Event) -> None:
    """``t_server``: the first answer that says diverged."""
    while not done.is_set():
        found = summary(base, job)
        if found is not None and found["state"] == "diverged":
            times["t_server"] = time.time()
            return
        time.sleep(0.02)


def alive(pids: set[int]) -> bool:
    """Whether any of ``pids`` runs (a zombie, ended but not yet reaped, does not)."""
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except OSError:
            continue
    return False


def watchdog_times(log: str) -> dict[str, float]:
    """The watchdog's timed lines: when it saw the divergence, called scancel, had it done."""
    marks = {"t_watchdog": " diverged", "t_scancel": "(scancel)", "t_cancelled": " cancelled"}
    times: dict[str, float] = {}
    for line in log.splitlines():
        match = WATCHDOG_LINE.match(line)
        if match is None:
            continue
        when = datetime.datetime.fromisoformat(match.group(1)).timestamp()
        for key, mark in marks.items():
            if key not in times and match.group(2).endswith(mark):
                times[key] = when
    return times


def one_job(
    cluster: slurm.Cluster, server: embedded.EmbeddedServer, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    base = server.http_url
    fault = f"overflow:rank=1:step={args.step}:module=blocks.1.mlp.fc2"
    trainer = ["--steps", "100000", "--step-time", str(args.step_time), "--fault", fault]
    job = cluster.sbatch(SCRIPT, *trainer, env=job_env(server), output=out)
    times: dict[str, Any] = {"job": job}
    done = threading.Event()
    poller = threading.Thread(target=watch_server, args=(base, job, times, done), daemon=True)
    poller.start()
    try:
        # Every process of the job, once both ranks train (before the fault).
        until(lambda: (s := summary(base, job)) and s["ranks_seen"] == 2, 300, 0.2, "2 ranks")
        pids = set(slurm.processes_with_env("SLURM_JOB_ID", job))
        ranks = pids & set(slurm.processes_with_env("TORCHELASTIC_RUN_ID", job))
        until(lambda: "t_server" in times, 300, 0.05, "the divergence")
        until(lambda: not alive(ranks), 120, 0.01, "the ranks to end")
        times["t_ranks_gone"] = time.time()
        until(lambda: not alive(pids), 120, 0.01, "the processes to end")
        times["t_gone"] = time.time()
        cluster.wait_for_state(job, slurm.FINAL_STATES, 120)
        times["t_end"] = time.time()
    finally:
        done.set()
    fields = cluster.job(job)
    verdict = request_json(run_url(base, job, "/verdict"))
    times.update(watchdog_times(out.read_text(errors="replace")))
    times.update(
        state=fields["JobState"],
        t_event=verdict["since"],
        t_ended=max(times["t_gone"], times["t_end"]),
        processes=len(pids),
        ranks=len(ranks),
        origin=[verdict["origin"][k] for k in ("rank", "module", "step", "phase")],
    )
    return times


def report(rows: list[dict[str, Any]]) -> None:
    print(f"{len(rows)} jobs; seconds: p50 / p99 / max")
    for name, start, end in PARTS:
        values = sorted(row[end] - row[start] for row in rows if start in row and end in row)
        if not values:
            print(f"  {name:<30} (no data)")
            continue
        p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
        print(f"  {name:<30} {statistics.median(values):6.3f} / {p99:6.3f} / {values[-1]:6.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = 2 if args.quick else args.jobs
    absent = slurm.missing()
    if absent:
        print(f"Slurm cannot start here, missing: {', '.join(absent)}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="nand-ttc-"))
    db_url = f"sqlite:///{folder / 'nand.db'}"
    server = embedded.start(db_url, settings=Settings(db_url=db_url, token=TOKEN))
    rows = []
    try:
        with slurm.cluster() as cluster:
            for index in range(jobs):
                row = one_job(cluster, server, args, folder / f"job-{index}.out")
                rows.append(row)
                print(json.dumps(row), flush=True)
                if row["state"] != "CANCELLED":
                    print(f"job {row['job']} ended {row['state']}, not CANCELLED", file=sys.stderr)
                    return 1
    finally:
        server.stop()
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
