"""Hosts: each host and GPU tallied across recent runs."""

from __future__ import annotations

from pydantic import BaseModel, Field


class GpuTally(BaseModel):
    """One GPU of a host across runs (see ``nand.server.analysis.hosts``)."""

    gpu: int = 0
    runs: int = 0
    ranks: int = 0
    #: Runs whose lone origin of a non-finite value ran here.
    incidents: int = 0
    #: Runs in which a rank here held parameters unlike the other replicas'.
    mismatches: int = 0
    #: Ranks here that exited with an exception.
    crashes: int = 0
    last_seen: float = 0.0


class HostTally(GpuTally):
    """One host across runs; ``gpu`` is unused (0), ``gpus`` breaks it down."""

    host: str
    gpus: list[GpuTally] = Field(default_factory=list)


class HostPage(BaseModel):
    """Hosts, worst first; ``runs``: how many recent runs were looked at."""

    items: list[HostTally]
    total: int
    runs: int
