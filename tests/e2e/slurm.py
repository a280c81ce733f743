"""A throwaway one-node Slurm cluster for the tests (Debian's Slurm 22.05, ``munge``).

``munged`` runs as the ``munge`` user on a fresh key, its socket in the
cluster's own directory; ``slurmctld`` and ``slurmd`` run as root in the
foreground (children of the test process), on free ports, with their state,
spool, logs and the job-completion log (``jobcomp/filetxt``) in that directory
too: two test sessions on one machine do not meet. No cgroups, no accounting
database: ``proctrack/linuxproc`` follows a job's processes by their parents,
and ``scontrol`` (``MinJobAge``) or the completion log keep final states.

Every process of the cluster and of its jobs carries ``SLURM_CONF=<this
cluster's slurm.conf>`` in its environment; :meth:`Cluster.stop` ends the
daemons, then any such process still there. ``scripts/test`` installs the
packages (``scripts/install-slurm``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nand.testing import free_port

#: What the cluster needs (Debian: slurmctld slurmd slurm-client munge).
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")
#: Seconds between a job's SIGTERM and SIGKILL (Slurm's default is 30).
KILL_WAIT_S = 5
#: Final states: the job is over (``COMPLETING`` is not: its processes are being ended).
FINAL_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def missing() -> list[str]:
    """The binaries that are not installed, and why the cluster cannot start here."""
    absent = [name for name in BINARIES if shutil.which(name, path=_sbin_path()) is None]
    if os.geteuid() != 0:
        absent.append("root (slurmd starts jobs as root here)")
    return absent


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _which(name: str) -> str:
    found = shutil.which(name, path=_sbin_path())
    if found is None:
        raise FileNotFoundError(name)
    return found


def slurm_conf(root: Path, node: str, cpus: int, memory_mb: int, ports: tuple[int, int]) -> str:
    return f"""\
ClusterName=nandtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=900
KillWait={KILL_WAIT_S}
InactiveLimit=0
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@dataclass
class Cluster:
    root: Path
    conf: Path
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client command (and of a job submitted with it)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *words: str, check: bool = True) -> str:
        done = subprocess.run(
            [_which(words[0]), *words[1:]],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(words)} failed: {done.stderr.strip()}\n{self.logs()}")
        return done.stdout

    def sbatch(self, script: Path, *args: str, env: dict[str, str], output: Path) -> str:
        """Submit ``script`` as a user does; the job id."""
        done = subprocess.run(
            [
                _which("sbatch"),
                "--parsable",
                "--open-mode=append",
                f"--output={output}",
                f"--chdir={script.parents[2]}",
                str(script),
                *args,
            ],
            capture_output=True,
            text=True,
            env={**env, "SLURM_CONF": str(self.conf)},
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}\n{self.logs()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ``Restarts``...)."""
        fields: dict[str, str] = {}
        for word in self.run("scontrol", "show", "job", "--oneliner", job).split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for_state(self, job: str, states: tuple[str, ...], timeout: float = 180.0) -> dict:
        """The job's fields once its state is one of ``states`` (and no longer completing)."""
        deadline = time.monotonic() + timeout
        fields = self.job(job)
        while not (fields["JobState"] in states and "COMPLETING" not in fields.get("Flags", "")):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} is {fields['JobState']}, not {states}")
            time.sleep(0.2)
            fields = self.job(job)
        return fields

    def completions(self) -> list[dict[str, str]]:
        """The job-completion log (``jobcomp/filetxt``): one dict per ended job."""
        path = self.root / "log" / "jobcomp.txt"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            rows.append(dict(word.partition("=")[::2] for word in line.split()))
        return rows

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel what runs, end the daemons, then every process left with this
        cluster's ``SLURM_CONF`` (a job step's ``slurmstepd``, a job's process)."""
        with contextlib.suppress(Exception):
            jobs = self.run("squeue", "--noheader", "--format=%i", check=False).split()
            if jobs:
                self.run("scancel", *jobs, check=False)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in processes_with_env("SLURM_CONF", str(self.conf)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of this machine's processes whose environment has ``name=value``."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or a kernel thread
            continue
        if wanted in environ:
            found.append(int(entry.name))
    return found


def start_cluster() -> Cluster:
    """Start munged, slurmctld and slurmd; return once a job step runs (``srun true``)."""
    root = Path(tempfile.mkdtemp(prefix="nand-slurm-"))
    os.chmod(root, 0o755)  # munged wants every directory above its socket reachable
    for name in ("state", "spool", "log"):
        (root / name).mkdir()
    node = socket.gethostname().split(".")[0]
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, node, os.cpu_count() or 1, memory_mb, _two_ports()))
    cluster = Cluster(root, conf)
    try:
        cluster.daemons.append(_start_munged(root, cluster.env))
        for daemon in ("slurmctld", "slurmd"):
            with open(root / "log" / f"{daemon}.out", "ab") as log:  # (the daemon has a copy)
                cluster.daemons.append(
                    subprocess.Popen(
                        [_which(daemon), "-D", "-f", str(conf)],
                        env=cluster.env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        cwd=root,
                    )
                )
        _wait_until_a_step_runs(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _two_ports() -> tuple[int, int]:
    first = free_port()
    second = free_port()
    while second == first:
        second = free_port()
    return first, second


def _start_munged(root: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """munged as ``munge`` on a fresh 1 KiB key, its socket under ``root/munge``."""
    user = pwd.getpwnam("munge")
    folder = root / "munge"
    folder.mkdir(mode=0o755)
    os.chown(folder, user.pw_uid, user.pw_gid)
    key = folder / "key"
    key.write_bytes(os.urandom(1024))
    os.chown(key, user.pw_uid, user.pw_gid)
    os.chmod(key, 0o400)
    proc = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={user.pw_uid}",
            f"--regid={user.pw_gid}",
            "--clear-groups",
            "--",
            _which("munged"),
            "--foreground",
            f"--socket={folder / 'socket'}",
            f"--key-file={key}",
            f"--log-file={folder / 'log'}",
            f"--pid-file={folder / 'pid'}",
            f"--seed-file={folder / 'seed'}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while not (folder / "socket").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            error = proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else ""
            raise RuntimeError(f"munged did not start: {error}")
        time.sleep(0.05)
    return proc


def _wait_until_a_step_runs(cluster: Cluster, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(
            [_which("srun"), "--ntasks=1", "--immediate=5", "true"],
            capture_output=True,
            text=True,
            env=cluster.env,
            timeout=timeout,
            check=False,
        )
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no job step ran: {done.stderr.strip()}\n{cluster.logs()}")
        time.sleep(0.5)


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    started = start_cluster()
    try:
        yield started
    finally:
        started.stop()
