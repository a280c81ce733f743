"""Who this agent is: run id, rank, local rank, world size, host and pid.

Rank and world size come from ``torch.distributed`` when it is initialised,
else from the launcher's environment (torchrun: ``RANK``/``LOCAL_RANK``/
``WORLD_SIZE``; Slurm: ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``),
else this is a single process (rank 0 of 1).

The run id must be the same on every rank without configuration:
``NAND_RUN``, else ``TORCHELASTIC_RUN_ID`` (unless torchrun's placeholder
``none``), else ``SLURM_JOB_ID``, else an id made up by the first rank to ask and shared
through the process group's key-value store (or torchrun's agent store before
the process group exists), else (single process) a fresh one. ``NAND_RUN`` must
keep the rule of :mod:`nand.runids` (``AgentConfig`` says so); a launcher's id,
not chosen for nand, is made one by :func:`nand.runids.run_id_from`.

>>> ident = resolve_identity(run="demo")
>>> (ident.run, ident.rank, ident.world_size) if "RANK" not in os.environ else ("demo", 0, 1)
('demo', 0, 1)
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from nand.runids import run_id_from

_STORE_KEY = "nand/run_id"


@dataclass(frozen=True)
class Identity:
    run: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_identity(run: str | None = None) -> Identity:
    """Who this process is; ``run`` (``nand.watch(run=...)`` or ``NAND_RUN``,
    resolved in ``AgentConfig``) wins over the launcher's id."""
    rank, local_rank, world_size = _rank_and_world()
    return Identity(
        run=run or launcher_run_id() or _agreed_run_id(),
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        host=socket.gethostname(),
        pid=os.getpid(),
    )


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def _rank_and_world() -> tuple[int, int, int]:
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    dist = _initialised_dist()
    if dist is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = _env_int("RANK", "SLURM_PROCID") or 0
        world = _env_int("WORLD_SIZE", "SLURM_NTASKS") or 1
    return rank, (local_rank if local_rank is not None else rank), world


def _initialised_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def distributed_up() -> bool:
    """Whether a ``torch.distributed`` process group is up in this process."""
    return _initialised_dist() is not None


def launcher_run_id() -> str | None:
    """The run id the launcher gives (torchrun's ``--rdzv-id``, Slurm's), made a
    valid run id (the same on every rank: it depends on the name only), if any."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic.lower() != "none":
        return run_id_from(elastic)
    return run_id_from(os.environ.get("SLURM_JOB_ID", ""))


def _new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


_agreed: dict[str, str] = {}


def _agreed_run_id() -> str:
    """An id made up once and shared by all ranks through a key-value store.

    Every rank offers a fresh id with ``compare_set`` on one key: the first
    offer wins and every rank reads the winner, so nobody waits for rank 0.
    The store is the default process group's when ``torch.distributed`` is
    initialised, else torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``,
    at ``MASTER_ADDR:MASTER_PORT``). This runs once per process, in
    ``nand.watch()``, never in the training loop. Without a store (a single
    process) the id is simply new.
    """
    store = _default_store() or _agent_store()
    if store is None:
        return _agreed.setdefault("local", _new_run_id())
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"{_STORE_KEY}/{restart}"
    if key not in _agreed:
        try:
            _agreed[key] = store.compare_set(key, "", _new_run_id()).decode()
        except Exception:  # an exotic store without compare_set: still run, unagreed
            _agreed[key] = _new_run_id()
    return _agreed[key]


def _default_store() -> Any:
    dist = _initialised_dist()
    if dist is None or dist.get_world_size() == 1:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def _agent_store() -> Any:
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    if (_env_int("WORLD_SIZE") or 1) <= 1 or not env.get("MASTER_ADDR"):
        return None
    try:
        from datetime import timedelta

        from torch._C._distributed_c10d import TCPStore  # (torch.distributed's own)

        port = int(env["MASTER_PORT"])
        timeout = timedelta(seconds=10)
        return TCPStore(env["MASTER_ADDR"], port, is_master=False, timeout=timeout)
    except Exception:
        return None
