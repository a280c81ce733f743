"""The package as a user installs it: the wheel, in a fresh venv, outside the checkout.

The sdist and the wheel are built (``python -m build``: the wheel from the
sdist, as a user's pip would from a source download) and checked (``twine
check --strict``); the wheel is installed into a new venv with its extras and
run from a temporary directory with no PYTHONPATH, so nothing of the checkout
can be imported. Whatever the checkout has that the wheel lacks (a dashboard
asset, a migration) fails here. Torch in that venv: the pinned CPU build,
installed by ``scripts/setup`` (its CPU-index probe) as on a user's machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import nand
from tests.server.pg import Cluster, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # (the venv's set-up: minutes)

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "nand" / "web"
#: An ES module's relative imports, static and dynamic.
IMPORTS = re.compile(r"""(?:from\s*|import\s*\(\s*)["']\./([\w./-]+)["']""")

#: A user's DDP script: rank 1's ``fc2`` makes +inf in its forward at step 3.
JOB = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import nand


class Planted(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        if dist.get_rank() == 1 and STEP[0] == 3:
            y = y * float("inf")  # the planted fault: fc2's output, rank 1, step 3
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), Planted(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.fc1(x))))


STEP = [0]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with nand.watch(model, optimizer=opt) as watch:
    for STEP[0] in range(6):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
"""


@dataclass
class Installed:
    """The fresh venv with the wheel, and how to run its commands as a user would."""

    bin: Path
    cwd: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            cwd=self.cwd,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return done


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def wheel_of(dist_dir: Path) -> Path:
    (wheel,) = dist_dir.glob("nand_torch-*-py3-none-any.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(dist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    venv = tmp_path_factory.mktemp("user") / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    # Torch first, the CPU build, with the set-up's probe of PyTorch's CPU index.
    setup = subprocess.run(
        [str(ROOT / "scripts" / "setup")],
        env={**env, "NAND_VENV": str(venv), "NAND_SETUP_ONLY": "torch"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    spec = f"{wheel_of(dist_dir)}[agent,server,postgres]"
    done = subprocess.run([*pip, spec], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cwd = tmp_path_factory.mktemp("elsewhere")
    return Installed(venv / "bin", cwd, env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:
        assert answer.status == 200, url
        return answer.read()


@dataclass
class Server:
    """``nand server`` from the venv, once it said where it listens."""

    proc: subprocess.Popen
    http_url: str
    zmq_endpoint: str


@contextlib.contextmanager
def nand_server(installed: Installed, db: str) -> Iterator[Server]:
    zmq = f"tcp://127.0.0.1:{free_port()}"
    command = [str(installed.bin / "nand"), "server", "--db", db, "--http", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [*command, "--zmq", zmq],
        cwd=installed.cwd,
        env=installed.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        said = []
        for line in proc.stdout:  # (until it says where it listens, or exits)
            said.append(line)
            if match := re.search(r"http=(\S+) zmq=(\S+)", line):
                break
        assert match, "nand server did not start: " + "".join(said)[-3000:]
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # (keep it drained)
        yield Server(proc, match[1], match[2])
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


@pytest.fixture
def server(installed: Installed, tmp_path: Path) -> Iterator[Server]:
    with nand_server(installed, f"sqlite:///{tmp_path / 'nand.db'}") as srv:
        yield srv


def test_the_sdist_and_the_wheel_pass_twine_check(dist_dir):
    files = sorted(str(p) for p in dist_dir.iterdir())
    assert [Path(f).name for f in files] == [
        f"nand_torch-{nand.__version__}-py3-none-any.whl",
        f"nand_torch-{nand.__version__}.tar.gz",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_wheel_holds_every_file_of_the_package_the_checkout_has(dist_dir):
    tracked = subprocess.run(
        ["git", "ls-files", "nand"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked
    names = set(zipfile.ZipFile(wheel_of(dist_dir)).namelist())
    assert [path for path in tracked if path not in names] == []
    assert f"nand_torch-{nand.__version__}.dist-info/licenses/LICENSE" in names


def test_the_installed_nand_is_the_wheel_and_says_its_version(installed):
    where = installed.run("python", "-c", "import nand; print(nand.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.bin.parent)
    version = installed.run("nand", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"nand {nand.__version__}")


def test_a_two_rank_job_is_reported_by_the_installed_server_cli_and_dashboard(installed, server):
    job = installed.cwd / "job.py"
    job.write_text(JOB)
    agents = {"NAND_SERVER": server.zmq_endpoint, "NAND_RUN": "wheel-run", "OMP_NUM_THREADS": "1"}
    torchrun = ("torchrun", "--standalone", "--nproc-per-node", "2", str(job))
    done = installed.run(*torchrun, timeout=600, **agents)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    url = ("--url", server.http_url)
    until = ("--until", "diverged", "--timeout", "120")
    waited = installed.run("nand", "wait", "wheel-run", *until, *url)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    said = installed.run("nand", "verdict", "wheel-run", "--json", *url)
    assert said.returncode == 0, said.stderr
    origin = json.loads(said.stdout)["origin"]
    assert (origin["rank"], origin["step"], origin["phase"]) == (1, 3, "forward")
    assert origin["module"] == "fc2"
    assert_dashboard_served_as_in_the_checkout(server.http_url)


def assert_dashboard_served_as_in_the_checkout(base: str) -> None:
    """The page, everything it links and imports, and every file of nand/web."""
    page = get(base + "/").decode()
    assert page == (WEB / "index.html").read_text()
    wanted = set(re.findall(r'(?:src|href)="([\w./-]+\.(?:js|css|svg))"', page))
    seen: set[str] = set()
    while wanted - seen:
        name = sorted(wanted - seen)[0]
        seen.add(name)
        body = get(f"{base}/{name}")
        assert body == (WEB / name).read_bytes(), name
        if name.endswith(".js"):
            imports = re.findall(
                r'(?:from\s*|import\s*\(\s*)["\']\./([\w./-]+)["\']', body.decode()
            )
            wanted |= {str(Path(name).parent / i).removeprefix("./") for i in imports}
    assert {"app.js", "style.css", "favicon.svg"} <= seen and len(seen) > 5
    for path in sorted(WEB.rglob("*")):
        if path.is_file() and path.suffix in (".js", ".css", ".svg", ".html"):
            assert get(f"{base}/{path.relative_to(WEB)}") == path.read_bytes(), path.name


def test_nand_demo_runs_from_the_installed_package(installed):
    demo = ("nand", "demo", "--no-wait", "--ranks", "2", "--steps", "12")
    done = installed.run(*demo, "--fault", "overflow:rank=1:step=6", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "diverged at step 6" in done.stdout, done.stdout[-3000:]
    assert "rank 1 produced" in done.stdout, done.stdout[-3000:]


@pytest.fixture(scope="module")
def pg() -> Iterator[Cluster]:
    cluster = start_cluster()
    yield cluster
    cluster.stop()


def test_the_installed_migrations_build_a_fresh_postgresql_database(installed, pg):
    import psycopg

    from nand.server.storage.migrate import head_revision

    with pg.database() as url:
        with nand_server(installed, url) as srv:
            assert json.loads(get(srv.http_url + "/api/runs")) is not None
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn) as conn:
            (revision,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
            tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables")}
    assert revision == head_revision()  # the checkout's newest migration, applied
    assert {"runs", "events"} <= tables
