"""The DDP replicas compared: a rank whose parameters differ from the others'.

Under DDP every rank holds the same parameters after every update (under
HSDP, every rank of a replica group: those holding the same shard; each
fingerprint names its group and only a group's ranks are compared). Every
``NAND_FINGERPRINT_STEPS`` steps each rank sends an exact fingerprint of
them, one integer per parameter (``nand.agent.step.fingerprint``). Here the
ranks' fingerprints of one step are compared as they arrive; the job runs no
collective for it. Two different fingerprints at one step mean that some
rank's weights are wrong while everything stays finite (silent data
corruption: a flipped bit in a GEMM, a bad memory cell). The run then reads
``replica_mismatch`` (``diverged`` stays worse), naming:

- the ranks that differ from the majority (with two replicas, or a tie, both
  sides: nobody can tell which is right);
- the first step at which they differed, and the last step at which every
  rank reported the same (the bracket: "between steps 100 and 200"; each
  rank's last fingerprint is of the state after its last step, so drift late
  in a run is bracketed up to its end);
- the parameters that differ.

Only a run's last :data:`KEEP_STEPS` fingerprinted steps are kept; what was
found stays on the run (``runs.replica_*``).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, select
from sqlalchemy import update as sql_update

from nand.events import RunState
from nand.server.schemas.verdict import ReplicaCheck
from nand.server.storage.db import insert_ignoring_conflicts
from nand.server.storage.models import Fingerprint, Run
from nand.server.storage.runids import RunIds

#: Fingerprinted steps kept per run (the comparison needs the latest only).
KEEP_STEPS = 8
#: At most this many differing parameters are named.
MAX_PARAMS = 50


def store(conn: Connection, messages: list[dict[str, Any]], run_ids: RunIds) -> None:
    """Store a batch's fingerprints and compare each step they touched."""
    if not messages:
        return
    rows = [_row(message, run_ids) for message in messages]
    conn.execute(insert_ignoring_conflicts(conn, Fingerprint.__table__), rows)
    touched = sorted({(row["run_id"], row["step"]) for row in rows})
    for run_id, step in touched:
        _compare(conn, run_id, step)
    for run_id in {run_id for run_id, _ in touched}:
        _prune(conn, run_id)


def _row(message: dict[str, Any], run_ids: RunIds) -> dict[str, Any]:
    body = message["body"]
    names, values = body["names"], body["values"]
    digest = hashlib.sha256(json.dumps([names, values]).encode()).hexdigest()[:32]
    return {
        "run_id": run_ids.of(message),
        "step": body["step"],
        "rank": message["rank"],
        "digest": digest,
        "names": names,
        "values": values,
        "replica_group": ",".join(str(c) for c in body.get("group") or ()),
    }


def _compare(conn: Connection, run_id: int, step: int) -> None:
    """What one step's fingerprints say; the earliest mismatch is kept."""
    run = conn.execute(
        select(Run.world_size, Run.replica_step, Run.replica_good_step).where(Run.id == run_id)
    ).one()
    if run.replica_step is not None and step > run.replica_step:
        return
    found = conn.execute(
        select(
            Fingerprint.rank,
            Fingerprint.digest,
            Fingerprint.names,
            Fingerprint.values,
            Fingerprint.replica_group,
        )
        .where(Fingerprint.run_id == run_id, Fingerprint.step == step)
        .order_by(Fingerprint.rank)
    ).all()
    groups: dict[str, list[Any]] = {}
    for row in found:
        groups.setdefault(row.replica_group, []).append(row)
    split = [rows for rows in groups.values() if len({row.digest for row in rows}) > 1]
    if split:
        ranks, params = differing(split[0])
        values = {"replica_step": step, "replica_ranks": ranks, "replica_params": params}
    elif len(found) >= max(2, run.world_size) and step > (run.replica_good_step or -1):
        values = {"replica_good_step": step}  # every rank reported, all the same
    else:
        return
    conn.execute(sql_update(Run).where(Run.id == run_id).values(**values))


def differing(found: Sequence[Any]) -> tuple[list[int], list[str]]:
    """The ranks outside the majority (both sides of a tie) and the parameters
    in which the first of them differs from a rank of the majority.

    >>> from types import SimpleNamespace as Row
    >>> rows = [Row(rank=r, digest=d, names=["w", "b"], values=v) for r, d, v in
    ...         [(0, "x", [1, 2]), (1, "y", [1, 3]), (2, "x", [1, 2])]]
    >>> differing(rows)
    ([1], ['b'])
    """
    counts = Counter(row.digest for row in found).most_common()
    tie = len(counts) > 1 and counts[0][1] == counts[1][1]
    reference = counts[0][0]
    if tie:
        odd = [row for row in found if row.digest in (counts[0][0], counts[1][0])]
    else:
        odd = [row for row in found if row.digest != reference]
    base = next(row for row in found if row.digest == reference)
    other = next(row for row in found if row.digest != reference)
    params = [
        name
        for name, mine, theirs in zip(other.names, other.values, base.values, strict=False)
        if mine != theirs
    ]
    if other.names != base.names:  # (a different model: nothing to pair up)
        params = sorted(set(other.names) ^ set(base.names))
    return sorted(row.rank for row in odd), params[:MAX_PARAMS]


def _prune(conn: Connection, run_id: int) -> None:
    steps = conn.execute(
        select(Fingerprint.step)
        .where(Fingerprint.run_id == run_id)
        .distinct()
        .order_by(Fingerprint.step.desc())
        .limit(KEEP_STEPS + 1)
    ).scalars()
    kept = list(steps)
    if len(kept) > KEEP_STEPS:
        conn.execute(
            delete(Fingerprint).where(
                Fingerprint.run_id == run_id, Fingerprint.step <= kept[KEEP_STEPS]
            )
        )


def run_state(state: RunState, run: Run) -> RunState:
    """A run's state once its replicas are compared: ``replica_mismatch``
    unless it diverged (a NaN says more, and stops a job by itself)."""
    if run.replica_step is not None and state != "diverged":
        return "replica_mismatch"
    return state


def check(run: Run) -> ReplicaCheck | None:
    """The verdict's ``replica`` (None: no step compared yet)."""
    if run.replica_step is not None:
        return ReplicaCheck(
            state="mismatch",
            ranks=run.replica_ranks or [],
            first_bad_step=run.replica_step,
            last_good_step=run.replica_good_step,
            params=run.replica_params or [],
            summary=sentence(run),
        )
    if run.replica_good_step is not None:
        return ReplicaCheck(state="consistent", last_good_step=run.replica_good_step)
    return None


def sentence(run: Run) -> str:
    """The mismatch in words a person on call can act on ("" without one)."""
    if run.replica_step is None:
        return ""
    ranks = run.replica_ranks or []
    who = (
        f"rank {ranks[0]}'s parameters differ from the other replicas'"
        if len(ranks) == 1
        else f"ranks {', '.join(map(str, ranks))} hold different parameters (no majority "
        "to tell which is right)"
    )
    good, bad = run.replica_good_step, run.replica_step
    # The bracket: every replica agreed at step `good` and not at `bad` (the
    # run's last step when the fingerprint each rank takes at close differs).
    since = f"at step {bad:,}" if good is None else f"between steps {good:,} and {bad:,}"
    params = run.replica_params or []
    shown = ", ".join(params[:5]) + (f" and {len(params) - 5} more" if len(params) > 5 else "")
    text = f"Replica mismatch: {who} {since}"
    text += f", in {shown}." if shown else "."
    checkpoint = f"before step {bad:,}" if good is None else f"at or before step {good:,}"
    return text + (
        " Everything is still finite, but that rank trains on wrong weights and "
        "the all-reduce spreads them: suspect its GPU or host (silent data "
        f"corruption), not the model; restart from a checkpoint taken {checkpoint}."
    )
