"""Who this agent is: run id, rank, local rank, world size, host and pid.

Rank and world size come from ``torch.distributed`` when it is initialised,
else from the launcher's environment (torchrun: ``RANK``/``LOCAL_RANK``/
``WORLD_SIZE``; Slurm: ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``),
else this is a single process (rank 0 of 1).

The run id must be the same on every rank without configuration:
``NAND_RUN``, else ``TORCHELASTIC_RUN_ID`` (unless torchrun's placeholder
``none``), else ``SLURM_JOB_ID``, else rank 0 makes one up and shares it through
the process group's key-value store, else (single process) a fresh one.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from nand import config

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
    rank, local_rank, world_size = _rank_and_world()
    return Identity(
        run=run or _run_id_from_env() or _agreed_run_id(rank),
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


def _run_id_from_env() -> str | None:
    explicit = config.get_str(config.NAND_RUN)
    if explicit:
        return explicit
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic.lower() != "none":
        return elastic
    return os.environ.get("SLURM_JOB_ID") or None


def _new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _agreed_run_id(rank: int) -> str:
    """Rank 0 makes an id up and shares it through the process group's store.

    This runs once, inside ``nand.watch()``, never in the training loop; the
    store's ``get`` waits (bounded by the store's timeout) for rank 0's ``set``.
    """
    dist = _initialised_dist()
    if dist is None or dist.get_world_size() == 1:
        return _new_run_id()
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        if rank == 0:
            store.set(_STORE_KEY, _new_run_id())
        return store.get(_STORE_KEY).decode()
    except Exception:  # an exotic backend without a store: still run, unagreed
        return _new_run_id()
