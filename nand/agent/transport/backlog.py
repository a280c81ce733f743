"""The sender's disk side: which spool file it writes, its limit, and dead agents' spools.

The spool of (run, rank) is opened on first need. Its path is the rank's
primary file; when a live agent of the same rank holds that one (a forked
child, a second watch in one process) the agent writes its own
``rank-R.<agent>.spool`` instead. A primary file that does not parse is moved
aside as ``.corrupt`` (the evidence stays) and a fresh one started. On start,
spools that dead agents of the rank left behind are adopted: the primary file
is simply kept, others are appended to it and deleted.

When the spool is full, it is compacted to half its limit (the marked records
stay: hello, the first incident, bye; heartbeats go first), and every record
lost that way is counted as dropped ``spool_full``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from nand.agent.transport import spool as spool_mod
from nand.agent.transport.mailbox import Mailbox
from nand.errors import SpoolCorruptError

log = logging.getLogger("nand.agent.transport")


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
        self._failed = False

    def __len__(self) -> int:
        return len(self.spool) if self.spool is not None else 0

    def append(self, data: bytes, kind: str, keep: bool) -> bool:
        """Append one frame; True when a compaction moved the records (offsets changed)."""
        spool = self._open()
        if spool is None:
            self.mailbox.drop("spool_error")
            return False
        if spool.append(data, kind=kind, keep=keep):
            return False
        lost = spool.compact(spool.max_bytes // 2)
        self.mailbox.drop("spool_full", sum(lost.values()))
        if not spool.append(data, kind=kind, keep=keep):
            self.mailbox.drop("spool_full")
        return True

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
            except Exception as exc:
                self.warn("orphan", f"nand: cannot replay the spool {path}: {exc}")
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(path.name + ".corrupt"))
        if len(self.spool):
            log.info("nand: replaying %d bytes spooled by an earlier agent", len(self.spool))
        return len(self.spool) > 0

    def _open(self) -> spool_mod.Spool | None:
        if self.spool is None and not self._failed:
            try:
                self.spool = self._claim()
            except Exception as exc:
                self._failed = True
                self.warn("spool", f"nand: cannot write the spool in {self.path}: {exc}")
        return self.spool

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
