"""``benchmarks/ranks100k.py latency`` at a small size, on what its figures are
quoted for: several servers on one PostgreSQL, the real wire, and every probe
found in the verdict (a benchmark that silently lost its probes would quote
the few it found)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

RANKS100K = Path(__file__).resolve().parents[2] / "benchmarks" / "ranks100k.py"


def test_the_latency_benchmark_finds_every_probe_through_two_servers_on_postgresql() -> None:
    command = [sys.executable, str(RANKS100K), "latency", "--ranks", "300", "--probes", "3"]
    command += ["--probe-at", "2", "--servers", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    said = r"\((\d+)/3 probes in it, \d+ named as its origin, ([^;]+); (\d+) sent"
    found = re.search(said, done.stdout)
    assert found, done.stdout
    in_it, last, sent = found.groups()
    assert (in_it, sent) == ("3", "3"), done.stdout
    # Probe i is at a step before probe i-1's: the last one sent is the run's
    # origin once every probe is in (earlier ones may have been it on the way,
    # in either order through two servers).
    assert last == "the last one at the end", done.stdout
    assert "2 server(s)" in done.stdout and "peak RSS MB" in done.stdout, done.stdout
