"""A throwaway PostgreSQL cluster for the tests (initdb + pg_ctl in a temp dir).

PostgreSQL refuses to run as root, so as root the cluster is owned by and run
as an unprivileged user (``postgres`` if it exists, else ``nobody``) through
``setpriv`` (util-linux) or, failing that, ``runuser``. The data directory is
made outside pytest's private (0700) temp dir so that user can reach it.
Binaries: ``$NAND_TEST_PG_BIN``, else ``pg_config --bindir``, else the newest
``/usr/lib/postgresql/*/bin``.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def find_bin() -> Path | None:
    explicit = os.environ.get("NAND_TEST_PG_BIN")
    candidates = [explicit] if explicit else []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_user_prefix() -> tuple[list[str], int, int]:
    """Command prefix that drops root, and the uid/gid it runs as."""
    if os.geteuid() != 0:
        return [], os.getuid(), os.getgid()
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        uid, gid = entry.pw_uid, entry.pw_gid
        if shutil.which("setpriv"):
            return (
                [
                    "setpriv",
                    f"--reuid={uid}",
                    f"--regid={gid}",
                    "--clear-groups",
                    "--",
                ],
                uid,
                gid,
            )
        if shutil.which("runuser"):
            return ["runuser", "-u", name, "--"], uid, gid
    raise RuntimeError("running as root with no way to switch to an unprivileged user")


@dataclass
class Cluster:
    bindir: Path
    root: Path
    port: int
    prefix: list[str]

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://nand@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        subprocess.run([*self.prefix, *args], check=True, capture_output=True, env=env, cwd="/")

    def start(self) -> None:
        data = self.root / "data"
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "nand",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(data),
            "-o",
            options,
            "-l",
            str(self.root / "log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        subprocess.run(
            [
                *self.prefix,
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.root / "data"),
                "-m",
                "immediate",
                "stop",
            ],
            capture_output=True,
            cwd="/",
        )
        shutil.rmtree(self.root, ignore_errors=True)

    @contextmanager
    def database(self) -> Iterator[str]:
        """A fresh database for one test; dropped afterwards."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        dsn = f"host=127.0.0.1 port={self.port} user=nand dbname=postgres"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://nand@127.0.0.1:{self.port}/{name}"
        finally:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_cluster() -> Cluster:
    bindir = find_bin()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL binaries not found (set NAND_TEST_PG_BIN)")
    prefix, uid, gid = _as_user_prefix()
    root = Path(tempfile.mkdtemp(prefix="nand-pg-"))
    os.chmod(root, 0o755)
    os.chown(root, uid, gid)
    cluster = Cluster(bindir, root, _free_port(), prefix)
    try:
        cluster.start()
    except subprocess.CalledProcessError as exc:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        cluster.stop()
        raise RuntimeError(f"PostgreSQL did not start: {exc.stderr!r} {log}") from exc
    return cluster
