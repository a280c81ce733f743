"""The agent's spool: wire frames the server has not acknowledged, on local disk.

One append-only file per (run, rank) and agent process, written only by the
agent's sender thread. Its grammar (integers big-endian)::

    spool   = header record* [torn-tail]
    header  = MAGIC VERSION RESERVED      ; 16 bytes
    MAGIC   = "NANDSPOL"                  ; 8 bytes
    VERSION = u16 (1)
    RESERVED= 6 zero bytes
    record  = length:u32 crc:u32 tag:u8 payload:length*u8
    crc     = crc32(tag || payload)
    tag     = kind-code (low 4 bits) | 0x80 when the record must survive compaction
    kind-code = 1 hello | 2 event | 3 heartbeat | 4 flight | 5 bye | 6 fingerprint | 7 warning
                ; nand.wire.kinds.KINDS' Kind.code
    payload = one nand.wire frame, byte for byte as it is (re)sent, so a replay
              keeps the original (agent, seq) and the server drops duplicates

A record is written with one ``write`` on an ``O_APPEND`` descriptor, so a
``kill -9`` leaves at most one torn record at the end: a tail that stops inside
a record, a last record whose CRC does not match, or a run of zero bytes (what
some filesystems leave after a crash) is tolerated and cut off on open. Any
other bad byte raises :class:`~nand.errors.SpoolCorruptError` with the offset.
Records are not fsync'ed one by one (a process crash keeps them; a power cut
may lose the last few); :meth:`Spool.close` fsyncs.

The file is locked (``flock``) while an agent owns it; an unlocked spool in the
directory belongs to a dead agent, and the next agent of the same run and rank
adopts it (:func:`orphans`). Compaction (when ``max_bytes`` is hit) rewrites the
file keeping the marked records (hello, the first incident, bye), then the
newest of the rest, heartbeats going first, events last (:data:`DROP_ORDER`).

>>> import tempfile, pathlib
>>> s = Spool(pathlib.Path(tempfile.mkdtemp()) / "rank-0.spool", max_bytes=1 << 20)
>>> s.append(b"\\x81\\xa1v\\x01", kind="heartbeat")
True
>>> [payload for _, _, payload in s.read_from(HEADER_SIZE)]
[b'\\x81\\xa1v\\x01']
>>> s.close()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from nand.errors import SpoolCorruptError
from nand.wire.kinds import KINDS, SPOOL_DROP_ORDER

MAGIC = b"NANDSPOL"
VERSION = 1
HEADER = MAGIC + struct.pack(">H", VERSION) + bytes(6)
HEADER_SIZE = len(HEADER)
_RECORD = struct.Struct(">IIB")
RECORD_OVERHEAD = _RECORD.size
#: A length above this is not a record the agent could have written.
MAX_RECORD = 64 * 1024 * 1024
KEEP = 0x80
#: Every kind of message an agent sends has a code (the tag's low 4 bits): the
#: wire's table of kinds is the one list, so a new kind is spooled like the others.
KIND_CODES = {kind.name: kind.code for kind in KINDS if kind.sender == "agent"}
KIND_NAMES = {code: name for name, code in KIND_CODES.items()}
#: Which unmarked records go first when the spool is full; kinds not named go last.
DROP_ORDER = SPOOL_DROP_ORDER
_DROP_RANK = {KIND_CODES[kind]: rank for rank, kind in enumerate(DROP_ORDER)}


def spool_path(spool_dir: str | os.PathLike[str], run: str, rank: int, suffix: str = "") -> Path:
    """Where the spool of (run, rank) lives; ``suffix`` names a second agent's file."""
    safe_run = re.sub(r"[^A-Za-z0-9._-]", "_", run)[:200] or "run"
    name = f"rank-{rank}{'.' + suffix if suffix else ''}.spool"
    return Path(spool_dir) / safe_run / name


def orphans(directory: Path, rank: int) -> list[Path]:
    """Spool files of dead agents of this rank (nobody holds their lock)."""
    found = []
    for path in sorted(directory.glob(f"rank-{rank}.*spool")):
        if not re.fullmatch(rf"rank-{rank}(\.[^.]+)?\.spool", path.name):
            continue
        with contextlib.suppress(OSError), open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live agent owns it
            found.append(path)
    return found


def encode_record(payload: bytes, tag: int) -> bytes:
    crc = zlib.crc32(bytes([tag]) + payload)
    return _RECORD.pack(len(payload), crc, tag) + payload


def scan(data: bytes, start: int = HEADER_SIZE) -> Iterator[tuple[int, int, bytes]]:
    """Yield (end offset, tag, payload) of each whole record; stop at a torn tail."""
    offset = start
    while offset < len(data):
        end = offset + RECORD_OVERHEAD
        if end > len(data):
            return _torn_or_corrupt(data, offset, "record header runs past the end")
        length, crc, tag = _RECORD.unpack_from(data, offset)
        problem = _record_problem(data, offset, length, crc, tag)
        if problem == "torn":
            return None
        if problem:
            return _torn_or_corrupt(data, offset, problem)
        offset = end + length
        yield offset, tag, data[end:offset]
    return None


def _record_problem(data: bytes, offset: int, length: int, crc: int, tag: int) -> str:
    start = offset + RECORD_OVERHEAD
    if length == 0 or length > MAX_RECORD or (tag & 0x0F) not in KIND_NAMES:
        return f"bad record header (length {length}, tag {tag:#x})"
    if start + length > len(data):
        return "torn"  # the write was cut short
    if zlib.crc32(data[offset + 8 : start + length]) != crc:
        return "CRC mismatch"
    return ""


def _torn_or_corrupt(data: bytes, offset: int, problem: str) -> None:
    rest = data[offset:]
    if not rest.strip(b"\x00"):
        return None  # zero fill after a crash
    # A bad record that is the last one is a torn write; one followed by a
    # valid record is damage in the middle of the file.
    for probe in range(offset + 1, len(data) - RECORD_OVERHEAD):
        length, crc, tag = _RECORD.unpack_from(data, probe)
        if not _record_problem(data, probe, length, crc, tag):
            raise SpoolCorruptError(f"spool corrupt at byte {offset}: {problem}")
    return None


def check_header(data: bytes, path: Path) -> None:
    if len(data) < HEADER_SIZE:
        if HEADER.startswith(data):
            return  # torn while the header was written: an empty spool
        raise SpoolCorruptError(f"{path}: not a nand spool (short header)")
    if data[:8] != MAGIC:
        raise SpoolCorruptError(f"{path}: not a nand spool (magic {data[:8]!r})")
    (version,) = struct.unpack_from(">H", data, 8)
    if version != VERSION:
        raise SpoolCorruptError(f"{path}: spool version {version}, expected {VERSION}")


def read_records(path: Path) -> list[tuple[int, bytes]]:
    """All whole records of a spool file as (tag, payload); for replay and inspection."""
    data = path.read_bytes()
    check_header(data, path)
    return [(tag, payload) for _, tag, payload in scan(data)]


class Spool:
    """An open, locked spool file. Used by one thread (the sender)."""

    def __init__(self, path: Path, *, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max(max_bytes, HEADER_SIZE + 1024)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.size = self._recover()
        except BaseException:
            os.close(self._fd)
            raise

    def _recover(self) -> int:
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        check_header(data, self.path)
        if len(data) < HEADER_SIZE:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, HEADER)
            return HEADER_SIZE
        end = HEADER_SIZE
        for record_end, _, _ in scan(data):
            end = record_end
        if end != len(data):
            os.ftruncate(self._fd, end)  # cut the torn tail before appending
        return end

    def __len__(self) -> int:
        return self.size - HEADER_SIZE

    def append(self, payload: bytes, *, kind: str, keep: bool = False) -> bool:
        """Append one frame; False when it would take the file past ``max_bytes``.

        Raises ``OSError`` when the disk refuses the write (full, over quota,
        failing); the file is then cut back to its last whole record, so a
        later append does not follow a torn one. ``ValueError`` for a kind
        that is not in :data:`KIND_CODES`.
        """
        if kind not in KIND_CODES:
            raise ValueError(f"no spool code for a message of kind {kind!r}")
        tag = KIND_CODES[kind] | (KEEP if keep else 0)
        record = encode_record(payload, tag)
        if self.size + len(record) > self.max_bytes:
            return False
        self._write_whole(record)
        return True

    def _write_whole(self, record: bytes) -> None:
        try:
            written = os.write(self._fd, record)
            if written != len(record):  # the disk filled up in the middle of it
                raise OSError(errno.ENOSPC, f"short write to {self.path} (disk full)")
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.size += len(record)

    def read_from(
        self, offset: int, max_records: int = 1000, max_bytes: int = 8 << 20
    ) -> list[tuple[int, int, bytes]]:
        """Up to ``max_records`` records from ``offset``: (end offset, tag, payload)."""
        out: list[tuple[int, int, bytes]] = []
        total = 0
        while offset < self.size and len(out) < max_records and total < max_bytes:
            head = os.pread(self._fd, RECORD_OVERHEAD, offset)
            length, crc, tag = _RECORD.unpack(head)
            payload = os.pread(self._fd, length, offset + RECORD_OVERHEAD)
            if len(payload) != length or zlib.crc32(bytes([tag]) + payload) != crc:
                raise SpoolCorruptError(f"{self.path}: record at byte {offset} changed on disk")
            offset += RECORD_OVERHEAD + length
            total += length
            out.append((offset, tag, payload))
        return out

    def compact(self, target_bytes: int, acked_upto: int = HEADER_SIZE) -> dict[str, int]:
        """Rewrite the file within ``target_bytes``; return the dropped kinds.

        Records that end at or before ``acked_upto`` were acknowledged by the
        server: they go first, and are not losses.
        """
        data = os.pread(self._fd, self.size, 0)
        records = [(tag, payload) for end, tag, payload in scan(data) if end > acked_upto]
        size = HEADER_SIZE + sum(RECORD_OVERHEAD + len(p) for _, p in records)
        victims = sorted(
            (i for i, (tag, _) in enumerate(records) if not tag & KEEP),
            key=lambda i: (_DROP_RANK.get(records[i][0] & 0x0F, len(DROP_ORDER)), i),
        )
        dropped: dict[str, int] = {}
        gone = set()
        for i in victims:
            if size <= target_bytes:
                break
            tag, payload = records[i]
            gone.add(i)
            size -= RECORD_OVERHEAD + len(payload)
            kind = KIND_NAMES[tag & 0x0F]
            dropped[kind] = dropped.get(kind, 0) + 1
        kept = [encode_record(p, t) for i, (t, p) in enumerate(records) if i not in gone]
        self._rewrite(HEADER + b"".join(kept))
        return dropped

    def _rewrite(self, content: bytes) -> None:
        # Write the new content to a locked temporary file, then rename it over
        # the spool: a crash in between leaves either the old or the new file
        # whole, and the lock moves with the new file.
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.write(fd, content) != len(content):
                raise OSError(errno.ENOSPC, f"short write to {tmp} (disk full)")
            os.fsync(fd)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()  # (a full disk: the old file stays whole and in use)
            raise
        os.close(self._fd)
        self._fd = fd
        self.size = len(content)

    def clear(self) -> None:
        """Everything was acknowledged: keep the (locked) file, empty."""
        os.ftruncate(self._fd, HEADER_SIZE)
        self.size = HEADER_SIZE

    def absorb(self, other: Path) -> int:
        """Append the whole records of a dead agent's spool, then delete it."""
        count = 0
        before = self.size
        try:
            for tag, payload in read_records(other):
                self._write_whole(encode_record(payload, tag))
                count += 1
        except OSError:  # (a full disk: the dead agent's file stays for later)
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, before)
            self.size = before
            raise
        other.unlink()
        return count

    def close(self, *, remove_if_empty: bool = True) -> None:
        if self._fd < 0:
            return
        if remove_if_empty and self.size <= HEADER_SIZE:
            with contextlib.suppress(OSError):
                self.path.unlink()
        else:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1

    def forget_after_fork(self) -> None:
        """In a forked child: drop the inherited descriptor without unlocking."""
        # Closing a duplicate descriptor keeps the parent's flock (it belongs
        # to the shared open file description); LOCK_UN here would release it.
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1
