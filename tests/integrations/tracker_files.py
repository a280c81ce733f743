"""Reading back what the trackers wrote, with their own formats and readers.

TensorBoard: its ``EventAccumulator``. W&B (offline): the run's ``.wandb``
transaction log, records decoded with W&B's own protobuf (``wandb.proto``).
wandb 0.31 ships no Python reader of that file (its Go core writes it), so
the framing is read here: the LevelDB log format W&B documents for it, a
7-byte file header (``:W&B``, magic, version), then 32 KiB blocks of chunks,
each ``crc32 (4) | length (2, LE) | type (1: full, 2: first, 3: middle, 4: last)``.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_file(wandb_dir: Path) -> Path:
    """The one offline run's transaction log under ``wandb_dir``."""
    (found,) = sorted(Path(wandb_dir).rglob("offline-run-*/run-*.wandb"))
    return found


def wandb_finished(wandb_dir: Path, timeout: float = 60.0) -> list[Any]:
    """The records of the one offline run under ``wandb_dir``, once its last
    is the ``exit`` record: ``run.finish()`` can return before W&B's core
    process has written the file's tail (seen here, under load)."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(wandb_file(wandb_dir))
        if records and records[-1].HasField("exit"):
            return records
        assert time.monotonic() < deadline, "the W&B run file has no exit record"
        time.sleep(0.1)


def wandb_records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, as W&B's ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, parts, pos = [], [], CHUNK_HEADER
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        start = pos + CHUNK_HEADER
        if start + length > len(data):
            break  # a tail still being written
        chunk, pos = data[start : start + length], start + length
        if kind not in (FULL, FIRST, MIDDLE, LAST):
            continue  # zero padding
        parts.append(chunk)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_alerts(records: list[Any]) -> list[tuple[str, str, str]]:
    """(level, title, text) of each alert, in order."""
    return [(r.alert.level, r.alert.title, r.alert.text) for r in records if r.HasField("alert")]


def wandb_summary(records: list[Any]) -> dict[str, Any]:
    """The run summary as it ended: every update applied in order."""
    summary: dict[str, Any] = {}
    for r in records:
        if r.HasField("summary"):
            for item in r.summary.update:
                summary[_key(item)] = json.loads(item.value_json)
    return summary


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    """The history rows, in order (NaN comes back as ``nan``)."""
    rows = []
    for r in records:
        if r.HasField("history"):
            rows.append({_key(item): json.loads(item.value_json) for item in r.history.item})
    return rows


def tensorboard(log_dir: Path) -> Any:
    """An ``EventAccumulator`` over every event file under ``log_dir``, loaded."""
    from tensorboard.backend.event_processing import event_accumulator

    (run_dir,) = {p.parent for p in Path(log_dir).rglob("events.out.tfevents.*")}
    acc = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.TENSORS: 0, event_accumulator.SCALARS: 0}
    )
    return acc.Reload()


def tb_texts(acc: Any, tag: str) -> list[tuple[int, str]]:
    """(step, text) of each ``add_text(tag, ...)``."""
    tags = acc.Tags()["tensors"]
    full = tag if tag in tags else f"{tag}/text_summary"
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(full)]


def tb_scalars(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def first_nonfinite(points: list[tuple[int, float]]) -> int | None:
    """The step of the first non-finite value of a scalar series: the loop's own truth."""
    return next((step for step, value in points if not math.isfinite(value)), None)
