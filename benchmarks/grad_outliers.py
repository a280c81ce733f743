"""What the per-rank gradient outliers cost (issue 18): the job and the server.

    python benchmarks/grad_outliers.py [--only transformer gpt ...] [--repeats 15]

1. The job. Under DDP nand's communication hook reduces each gradient bucket
   before the all-reduce (``nand.agent.detect.ddp``). It used to take an
   ``aminmax`` (the finite flag); it now takes the bucket's float32 norm, which
   is both the flag and the local norm the server compares. For each benchmark
   model, one training step's gradients are packed into DDP's 25 MiB buckets
   and, in one process and one thread, interleaved repeats time a training
   step, the old reduction of every bucket and the new one (CPU time; medians).
2. The server. ``write_batch`` of the heartbeats of 8 ranks, each in a batch
   of its own (the ranks' heartbeat clocks are not in step, so the norms of
   the first 7 wait in the database and the 8th completes the steps), each
   carrying 50 steps' local norms (a 10-steps-per-second job at the default
   5-second heartbeat), against the same heartbeats without norms; SQLite
   file, interleaved repeats, medians of wall time per heartbeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.overhead import BENCHES, make_optimizer
from nand import wire
from nand.server.agents.writer import write_batch
from nand.server.storage.db import make_engine
from nand.server.storage.migrate import upgrade

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
RANKS, STEPS_PER_BEAT = 8, 50


def buckets_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's gradients, flattened into DDP-sized buckets."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    per_bucket = BUCKET_BYTES // flat.element_size()
    return list(flat.split(per_bucket))


def old_reduction(buckets: list[torch.Tensor]) -> float:
    extremes = [t for b in buckets for t in torch.aminmax(b)]
    return float(torch.stack(extremes).sum(dtype=torch.float64))


def new_reduction(buckets: list[torch.Tensor]) -> float:
    norms = [torch.linalg.vector_norm(b, dtype=torch.float32) for b in buckets]
    return float(torch.linalg.vector_norm(torch.stack(norms), dtype=torch.float64))


def cpu_time(call: Callable[[], object]) -> float:
    started = time.process_time()
    call()
    return time.process_time() - started


def measure_job(name: str, repeats: int) -> dict[str, float]:
    bench = BENCHES[name]
    model, inputs, loss_fn = bench.make()
    opt = make_optimizer(bench.optimizer, model)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(inputs())).backward()
        opt.step()

    step()
    buckets = buckets_of(model)
    timings: dict[str, list[float]] = {"step": [], "old": [], "new": []}
    for _ in range(repeats):
        timings["step"].append(cpu_time(step))
        timings["old"].append(cpu_time(lambda: old_reduction(buckets)))
        timings["new"].append(cpu_time(lambda: new_reduction(buckets)))
    found = {key: statistics.median(values) for key, values in timings.items()}
    found["buckets"] = len(buckets)
    return found


def heartbeats(run: str, first_step: int, with_norms: bool) -> list[dict]:
    messages = []
    for rank in range(RANKS):
        steps = range(first_step, first_step + STEPS_PER_BEAT)
        body = {"step": steps[-1], "steps_per_s": 10.0, "loss": 2.0, "grad_norm": 1.0}
        if with_norms:
            body["local_grad_norms"] = [[s, 1.0 + 0.01 * ((s + rank) % 7)] for s in steps]
        agent = f"{run}-{rank}"
        message = wire.agent_message(
            "heartbeat", agent=agent, seq=first_step + 1, run=run, rank=rank, body=body
        )
        messages.append(wire.decode(wire.encode(message)))
    return messages


def measure_server(repeats: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{tmp}/bench.db")
        upgrade(engine)
        runs = {flag: uuid.uuid4().hex[:8] for flag in (False, True)}
        for run in runs.values():  # (hellos first: the runs and ranks exist)
            hellos = [
                wire.decode(
                    wire.encode(
                        wire.agent_message(
                            "hello",
                            agent=f"{run}-{r}",
                            seq=0,
                            run=run,
                            rank=r,
                            body={"world_size": RANKS, "host": "h", "pid": 1},
                        )
                    )
                )
                for r in range(RANKS)
            ]
            write_batch(engine, hellos, time.time())
        timings: dict[bool, list[float]] = {False: [], True: []}
        for i in range(repeats):
            for flag, run in runs.items():
                beats = heartbeats(run, i * STEPS_PER_BEAT, flag)
                started = time.perf_counter()
                for beat in beats:  # one batch each: the ranks' heartbeats are not in step
                    write_batch(engine, [beat], time.time())
                timings[flag].append((time.perf_counter() - started) / len(beats))
        engine.dispose()
    return statistics.median(timings[False]), statistics.median(timings[True])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHES), default=["transformer", "gpt", "resnet18"]
    )
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} interleaved repeats (CPU time)")
    for name in args.only:
        found = measure_job(name, args.repeats)
        step, old, new = found["step"], found["old"], found["new"]
        print(
            f"{BENCHES[name].title}: step {step * 1e3:.1f} ms; {found['buckets']:.0f} bucket(s): "
            f"aminmax {old * 1e3:.2f} ms ({100 * old / step:.2f}%), "
            f"norm {new * 1e3:.2f} ms ({100 * new / step:.2f}%), new/old {new / old:.2f}"
        )
    plain, with_norms = measure_server(args.repeats)
    print(
        f"server, a heartbeat of {RANKS} ranks': {plain * 1e3:.2f} ms without local norms, "
        f"{with_norms * 1e3:.2f} ms with {STEPS_PER_BEAT} steps' "
        f"({with_norms / plain:.2f}x, +{(with_norms - plain) * 1e3:.2f} ms)"
    )


if __name__ == "__main__":
    main()
