"""What the agent delivers through a full disk, a long outage and a reconnect.

    python benchmarks/delivery.py            # needs root for the 1 MiB tmpfs
    python benchmarks/delivery.py --skip-disk

One agent (``ServerSink``, its real sender thread and spool) against a real
ZeroMQ receiver (``nand.testing.Receiver``: it stores and acknowledges every
frame, and counts the duplicates). Three scenarios, each printing what was
submitted, stored (distinct), counted as dropped by reason, and lost without
being counted (submitted - stored - counted; over-counted when negative):

- **full disk**: the spool directory is a 1 MiB tmpfs; the server is down
  for 20,000 heartbeats, then up for 2,000 more;
- **steady traffic after an outage**: 1 s without a server, then 3 s of
  heartbeats in bursts with the server back; how many messages still went
  through the disk in the last second, and the mode at the end; against the
  receiver (acks at once) and against a real ``nand server`` on SQLite
  (acks after each commit, so something is always in flight);
- **reconnect mid-replay**: a 1.5 s outage, the server back until half the
  spool is stored, gone again for 0.3 s, back: duplicates the server got.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.events import Event, StepSummary
from nand.testing import Receiver, free_endpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nand.testing import free_port
from tests.server.processes import ServerProcess

ME = Identity(run="bench", rank=0, local_rank=0, world_size=1, host="h", pid=1)
FAST: dict[str, Any] = {"ack_timeout_s": 0.3, "connect_grace_s": 0.1, "poll_interval_s": 0.02}


def beat(step: int) -> StepSummary:
    return StepSummary(step=step, loss=1.0, grad_norm=2.0, steps_per_s=10.0)


def burst(sink: ServerSink, seconds: float, first: int, size: int = 20) -> int:
    step, end = first, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(size):
            sink.heartbeat(beat(step))
            step += 1
        time.sleep(0.002)
    return step


def accounting(sink: ServerSink, rx: Receiver) -> str:
    submitted = sink.stats()["submitted"]
    stored = len(set(rx.seqs(sink.agent)))
    dropped = sink.dropped()
    silent = submitted - stored - sum(dropped.values())
    return f"submitted {submitted}, stored {stored}, counted {dropped}, lost uncounted {silent}"


def full_disk(root: Path) -> None:
    disk = root / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        endpoint = free_endpoint()
        sink = ServerSink(endpoint, ME, spool_dir=disk, **FAST)
        sink.hello({})
        sink.event(Event(run="bench", module="first", nan=1), None)
        for step in range(20_000):
            sink.heartbeat(beat(step))
            if step % 500 == 0:
                time.sleep(0.02)
        with Receiver(endpoint) as rx:
            rx.wait_for(lambda: sink.stats()["connected"])
            for step in range(20_000, 22_000):
                sink.heartbeat(beat(step))
                time.sleep(0.001)
            sink.flush(30)
            first_kept = any(m["kind"] == "event" for m in rx.messages[sink.agent])
            print(f"full disk: {accounting(sink, rx)}; first incident stored: {first_kept}")
            print(f"  mode at the end: {sink.stats()['mode']}")
            sink.close()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def steady_after_outage(root: Path) -> None:
    endpoint = free_endpoint()
    sink = ServerSink(endpoint, ME, spool_dir=root / "steady", **FAST)
    sink.hello({})
    step = burst(sink, 1.0, 0)
    with Receiver(endpoint) as rx:
        steady(sink, step, "receiver")
        sink.flush(30)
        print(f"  {accounting(sink, rx)}")
        sink.close()
    port = free_port()
    sink = ServerSink(f"tcp://127.0.0.1:{port}", ME, spool_dir=root / "steady2", **FAST)
    sink.hello({})
    step = burst(sink, 1.0, 0)
    server = ServerProcess(f"sqlite:///{root / 'steady.db'}", port).start()
    try:
        steady(sink, step, "nand server")
        print(f"  flushed: {sink.flush(30)}")
        sink.close()
    finally:
        server.stop()


def steady(sink: ServerSink, step: int, against: str) -> None:
    step = burst(sink, 2.0, step)
    spooled, submitted = sink.stats()["spooled"], sink.stats()["submitted"]
    burst(sink, 1.0, step)
    stats = sink.stats()
    through_disk = stats["spooled"] - spooled
    print(
        f"steady traffic after an outage ({against}): in the last second {through_disk} of "
        f"{stats['submitted'] - submitted} messages went through the disk; mode {stats['mode']}"
    )


def reconnect_mid_replay(root: Path) -> None:
    endpoint = free_endpoint()
    sink = ServerSink(endpoint, ME, spool_dir=root / "reconnect", **FAST)
    sink.hello({})
    step = burst(sink, 1.5, 0, size=40)
    on_disk = sink.stats()["spooled"]
    rx = Receiver(endpoint).start()
    try:
        rx.wait_for(lambda: rx.count() > on_disk // 2)
        rx.stop()
        step = burst(sink, 0.3, step)
        rx.start()
        burst(sink, 0.5, step)
        sink.flush(30)
        print(f"reconnect mid-replay: {on_disk} spooled, {rx.duplicates} duplicates at the server")
        print(f"  {accounting(sink, rx)}")
        sink.close()
    finally:
        rx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-disk", action="store_true", help="no tmpfs (needs root)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not args.skip_disk:
            full_disk(root)
        steady_after_outage(root)
        reconnect_mid_replay(root)


if __name__ == "__main__":
    main()
