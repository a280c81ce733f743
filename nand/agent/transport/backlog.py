"""The sender's disk side: which spool file it writes, its limit, and dead agents' spools.

The spool of (run, rank) is opened on first need. Its path is the rank's
primary file; when a live agent of the same rank holds that one (a forked
child, a second watch in one process) the agent writes its own
``rank-R.<agent>.spool`` instead. A primary file that does not parse is moved
aside as ``.corrupt`` (the evidence stays) and a fresh one started. On start,
spools that dead agents of the rank left behind are adopted: the primary file
is simply kept, others are appended to it and deleted.

When the spool is full, it is compacted to half its limit: records the server
already acknowledged go first (they are not losses), then unmarked records in
:data:`~nand.agent.transport.spool.DROP_ORDER` (heartbeats first, events
last); the marked records stay (hello, the first incident, bye). Every
record lost that way is counted as dropped ``spool_full``.

When the disk refuses (full, over quota, failing, or the spool cannot be
opened) the frame is *refused*: the sender keeps it in memory instead, within
its own bound, and counts what that bound drops as ``disk_full`` (or
``spool_error``). The disk is tried again after :data:`DISK_RETRY_S`. Any
other failure to spool a frame (a bug of nand's) is refused the same way, as
``spool_error``: the frame and those after it wait in memory, never dropped
uncounted.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from nand.agent.transport import spool as spool_mod
from nand.agent.transport.mailbox import Mailbox
from nand.errors import SpoolCorruptError

log = logging.getLogger("nand.agent.transport")


#: What :meth:`Backlog.append` did with a frame: on disk; on disk after a
#: compaction moved the records (offsets changed); refused (keep it in memory).
Stored = Literal["stored", "moved", "refused"]
#: After the disk refused a write, it is left alone this long.
DISK_RETRY_S = 5.0


class Backlog:
    def __init__(
        self,
        path: Path,
        agent: str,
        max_bytes: int,
        mailbox: Mailbox,
        warn: Callable[[str, str], None],
    ) -> None:
        self.path = path
        self.agent = agent
        self.max_bytes = max_bytes
        self.mailbox = mailbox
        self.warn = warn
        self.spool: spool_mod.Spool | None = None
        #: Records ending at or before this offset are acknowledged (the sender keeps it).
        self.acked_upto = spool_mod.HEADER_SIZE
        #: Why the disk refused last (``disk_full`` or ``spool_error``), while it does.
        self.refusal: str | None = None
        self._retry_at = 0.0

    def __len__(self) -> int:
        return len(self.spool) if self.spool is not None else 0

    def append(self, data: bytes, kind: str, keep: bool) -> Stored:
        """Put one frame on disk, or say it is refused (the caller keeps it)."""
        if self.refusal is not None and time.monotonic() < self._retry_at:
            return "refused"
        spool = self._open()
        if spool is None:
            return "refused"
        try:
            stored = self._append(spool, data, kind, keep)
        except OSError as exc:
            self._refused(exc)
            return "refused"
        except Exception as exc:  # not the disk: nand's own bug, e.g. a kind without a code
            self._refused(OSError(errno.EIO, f"{type(exc).__name__}: {exc}"))
            return "refused"
        self.refusal = None
        return stored

    def _append(self, spool: spool_mod.Spool, data: bytes, kind: str, keep: bool) -> Stored:
        if spool.append(data, kind=kind, keep=keep):
            return "stored"
        lost = spool.compact(spool.max_bytes // 2, self.acked_upto)
        self.acked_upto = spool_mod.HEADER_SIZE
        self.mailbox.drop("spool_full", sum(lost.values()))
        if not spool.append(data, kind=kind, keep=keep):
            self.mailbox.drop("spool_full")
        return "moved"

    def _refused(self, exc: OSError) -> None:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        self.refusal = "disk_full" if full else "spool_error"
        self._retry_at = time.monotonic() + DISK_RETRY_S
        self.warn(
            self.refusal,
            f"nand: cannot write the spool {self.path} ({exc.strerror or exc}); "
            "messages are kept in memory meanwhile (the oldest heartbeats are dropped first, "
            "and counted)",
        )

    def adopt_orphans(self, rank: int) -> bool:
        """Take over what dead agents of this rank spooled; True if there is any."""
        found = spool_mod.orphans(self.path.parent, rank)
        if not found or self._open() is None:
            return False
        assert self.spool is not None
        for path in found:
            if path == self.spool.path:
                continue  # our own file now: its records stay in place
            try:
                self.spool.absorb(path)
            except OSError as exc:  # the disk, not the file: it stays for a later agent
                self._refused(exc)
                break
            except Exception as exc:
                self.warn("orphan", f"nand: cannot replay the spool {path}: {exc}")
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(path.name + ".corrupt"))
        if len(self.spool):
            log.info("nand: replaying %d bytes spooled by an earlier agent", len(self.spool))
        return len(self.spool) > 0

    def _open(self) -> spool_mod.Spool | None:
        if self.spool is None:
            try:
                self.spool = self._claim()
                self.acked_upto = spool_mod.HEADER_SIZE
            except OSError as exc:
                self._refused(exc)
            except Exception as exc:  # (e.g. a corrupt file that cannot be moved aside)
                self._refused(OSError(errno.EIO, str(exc)))
        return self.spool

    def clear(self) -> None:
        """Everything on disk was acknowledged: empty the file."""
        if self.spool is not None:
            self.spool.clear()
        self.acked_upto = spool_mod.HEADER_SIZE

    def _claim(self) -> spool_mod.Spool:
        try:
            return spool_mod.Spool(self.path, max_bytes=self.max_bytes)
        except SpoolCorruptError as exc:  # keep the evidence aside, start afresh
            self.warn("corrupt", f"nand: {exc}; moved aside as .corrupt")
            self.path.rename(self.path.with_name(self.path.name + ".corrupt"))
            return spool_mod.Spool(self.path, max_bytes=self.max_bytes)
        except BlockingIOError:  # another live agent of this rank (e.g. a forked child)
            own = self.path.with_name(self.path.name.replace(".spool", f".{self.agent[:12]}.spool"))
            return spool_mod.Spool(own, max_bytes=self.max_bytes)

    def close(self) -> None:
        if self.spool is not None:
            with contextlib.suppress(Exception):
                self.spool.close()

    def forget_after_fork(self) -> None:
        if self.spool is not None:
            self.spool.forget_after_fork()
