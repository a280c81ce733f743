"""The spool file: its grammar, torn tails, real corruption, limits and locks."""

from __future__ import annotations

import fcntl
import re
import struct
import zlib
from pathlib import Path

import pytest

from nand import cli, wire
from nand.agent.transport import spool as sp
from nand.errors import SpoolCorruptError


def _frames(n: int, size: int = 40) -> list[bytes]:
    return [bytes([i % 251 + 1]) * size for i in range(n)]


def _write(path: Path, frames: list[bytes], kind: str = "heartbeat") -> None:
    s = sp.Spool(path, max_bytes=1 << 30)
    for f in frames:
        assert s.append(f, kind=kind)
    s.close()


def test_file_follows_the_documented_grammar(tmp_path):
    path = tmp_path / "rank-0.spool"
    s = sp.Spool(path, max_bytes=1 << 20)
    s.append(b"hello-bytes", kind="hello", keep=True)
    s.append(b"beat", kind="heartbeat")
    s.close()
    data = path.read_bytes()
    assert data[:8] == b"NANDSPOL" and struct.unpack(">H", data[8:10]) == (1,)
    assert data[10:16] == bytes(6)
    length, crc, tag = struct.unpack(">IIB", data[16:25])
    assert (length, tag) == (11, 0x80 | 1)
    assert crc == zlib.crc32(bytes([tag]) + b"hello-bytes")
    assert data[25:36] == b"hello-bytes"
    assert sp.read_records(path) == [(0x81, b"hello-bytes"), (3, b"beat")]


def test_records_read_back_in_order_after_reopening(tmp_path):
    path = tmp_path / "rank-0.spool"
    frames = _frames(50)
    _write(path, frames)
    s = sp.Spool(path, max_bytes=1 << 20)
    assert [p for _, _, p in s.read_from(sp.HEADER_SIZE, max_records=1000)] == frames
    assert [p for _, _, p in s.read_from(sp.HEADER_SIZE, max_records=7)] == frames[:7]
    s.close()


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_a_torn_last_record_is_dropped_and_cut_off_on_open(tmp_path, cut):
    path = tmp_path / "rank-0.spool"
    frames = _frames(10)
    _write(path, frames)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    assert [p for _, p in sp.read_records(path)] == frames[:9]
    s = sp.Spool(path, max_bytes=1 << 20)  # cuts the tail, then appends after it
    s.append(b"after-crash", kind="heartbeat")
    s.close()
    assert [p for _, p in sp.read_records(path)] == [*frames[:9], b"after-crash"]


def test_a_zero_filled_tail_and_a_torn_header_are_tolerated(tmp_path):
    path = tmp_path / "rank-0.spool"
    _write(path, _frames(3))
    path.write_bytes(path.read_bytes() + bytes(4096))
    assert len(sp.read_records(path)) == 3
    empty = tmp_path / "rank-1.spool"
    empty.write_bytes(sp.HEADER[:5])
    assert sp.read_records(empty) == []
    sp.Spool(empty, max_bytes=1 << 20).close(remove_if_empty=False)
    assert empty.read_bytes() == sp.HEADER


def test_a_bad_record_in_the_middle_raises_spool_corrupt_error(tmp_path):
    path = tmp_path / "rank-0.spool"
    _write(path, _frames(10))
    data = bytearray(path.read_bytes())
    data[sp.HEADER_SIZE + 3 * (sp.RECORD_OVERHEAD + 40) + 20] ^= 0xFF  # inside record 3
    path.write_bytes(bytes(data))
    with pytest.raises(SpoolCorruptError, match="CRC mismatch"):
        sp.read_records(path)
    with pytest.raises(SpoolCorruptError):
        sp.Spool(path, max_bytes=1 << 20)


def test_a_file_that_is_not_a_spool_raises_spool_corrupt_error(tmp_path):
    path = tmp_path / "rank-0.spool"
    path.write_bytes(b"GIF89a" + bytes(100))
    with pytest.raises(SpoolCorruptError, match="not a nand spool"):
        sp.read_records(path)
    path.write_bytes(b"NANDSPOL" + struct.pack(">H", 7) + bytes(6))
    with pytest.raises(SpoolCorruptError, match="version 7"):
        sp.read_records(path)


def test_append_refuses_past_the_limit_and_compaction_keeps_marked_and_newest(tmp_path):
    path = tmp_path / "rank-0.spool"
    s = sp.Spool(path, max_bytes=4096)
    assert s.append(b"H" * 40, kind="hello", keep=True)
    assert s.append(b"E" * 40, kind="event", keep=True)  # the first incident
    n = 0
    while s.append(n.to_bytes(4, "big") * 10, kind="heartbeat"):
        n += 1
    assert s.size <= 4096
    dropped = s.compact(2048)
    assert s.size <= 2048 and dropped["heartbeat"] > 0
    kept = sp.read_records(path)
    assert kept[0] == (0x81, b"H" * 40) and kept[1] == (0x82, b"E" * 40)
    beats = [int.from_bytes(p[:4], "big") for t, p in kept[2:]]
    assert beats == list(range(n - len(beats), n))  # the newest, in order
    s.close()


def test_compaction_drops_heartbeats_before_other_events(tmp_path):
    s = sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    for i in range(20):
        s.append(b"beat%03d" % i, kind="heartbeat")
        if i % 5 == 0:
            s.append(b"event%03d" % i, kind="event")
    dropped = s.compact(sp.HEADER_SIZE + 6 * (sp.RECORD_OVERHEAD + 8))
    assert dropped == {"heartbeat": 20 - 2}
    kinds = [t for _, t, _ in s.read_from(sp.HEADER_SIZE)]
    assert kinds.count(2) == 4 and kinds.count(3) == 2
    s.close()


def test_a_locked_spool_is_not_an_orphan_and_cannot_be_opened_twice(tmp_path):
    live = sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    live.append(b"x", kind="heartbeat")
    _write(tmp_path / "rank-0.deadbeef.spool", _frames(2))
    _write(tmp_path / "rank-1.spool", _frames(2))
    assert sp.orphans(tmp_path, 0) == [tmp_path / "rank-0.deadbeef.spool"]
    with pytest.raises(BlockingIOError):
        sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    live.close()
    assert tmp_path / "rank-0.spool" in sp.orphans(tmp_path, 0)


def test_absorbing_an_orphan_appends_its_records_and_deletes_it(tmp_path):
    orphan = tmp_path / "rank-0.old.spool"
    _write(orphan, _frames(3))
    s = sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    assert s.absorb(orphan) == 3 and not orphan.exists()
    assert [p for _, _, p in s.read_from(sp.HEADER_SIZE)] == _frames(3)
    s.clear()
    assert len(s) == 0
    s.close()
    assert not (tmp_path / "rank-0.spool").exists()  # empty spools do not linger


def test_an_empty_spool_keeps_its_lock_until_closed(tmp_path):
    s = sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    with open(tmp_path / "rank-0.spool", "rb") as f, pytest.raises(BlockingIOError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    s.close()


def test_spool_path_is_per_run_and_rank_and_safe():
    assert sp.spool_path("/s", "my run/../x", 3) == Path("/s/my_run_.._x/rank-3.spool")
    assert sp.spool_path("/s", "r", 0, "abc").name == "rank-0.abc.spool"


def test_every_kind_an_agent_sends_is_spooled_and_listed_by_nand_spool_show(tmp_path, capsys):
    """The wire's list of agent kinds is the spool's: a new kind joins here by itself."""
    path = tmp_path / "rank-0.spool"
    s = sp.Spool(path, max_bytes=1 << 20)
    for seq, kind in enumerate(wire.AGENT_KINDS, start=1):
        message = wire.agent_message(kind, agent="a1", seq=seq, run="r", rank=0, body={})
        assert s.append(wire.encode(message), kind=kind)
    s.close()
    tags = [tag for tag, _ in sp.read_records(path)]
    assert [sp.KIND_NAMES[tag & 0x0F] for tag in tags] == list(wire.AGENT_KINDS)
    assert all(0 < tag <= 0x0F for tag in tags)  # a kind code fits the tag's low 4 bits
    assert cli.main(["spool", "show", str(path)]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == list(wire.AGENT_KINDS)


def test_a_kind_without_a_code_is_a_value_error_that_writes_nothing(tmp_path):
    s = sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    with pytest.raises(ValueError, match="no spool code for a message of kind 'novel'"):
        s.append(b"x", kind="novel")
    assert len(s) == 0
    s.close()


def test_the_kind_codes_on_disk_are_the_documented_ones_and_older_spools_read_the_same(tmp_path):
    grammar = re.search(r"kind-code = (.+)", sp.__doc__ or "")
    assert grammar is not None
    documented = {name: int(code) for code, name in re.findall(r"(\d+) (\w+)", grammar.group(1))}
    assert documented == sp.KIND_CODES
    # A spool written before fingerprints and warnings existed (codes 1..5):
    # kinds may only be appended to the wire's list, never reordered.
    older = {1: "hello", 2: "event", 3: "heartbeat", 4: "flight", 5: "bye"}
    path = tmp_path / "rank-0.spool"
    path.write_bytes(sp.HEADER + b"".join(sp.encode_record(b"m", code) for code in older))
    assert [sp.KIND_NAMES[tag] for tag, _ in sp.read_records(path)] == list(older.values())


def test_compaction_drops_heartbeats_first_events_last_and_never_marked_records(tmp_path):
    s = sp.Spool(tmp_path / "rank-0.spool", max_bytes=1 << 20)
    unmarked = [kind for kind in wire.AGENT_KINDS if kind not in ("hello", "bye")]
    assert sorted(unmarked) == sorted(sp.DROP_ORDER)  # every kind has its place
    s.append(b"hello", kind="hello", keep=True)
    for kind in reversed(sp.DROP_ORDER):  # written in the reverse of the drop order
        s.append(kind.encode().ljust(16), kind=kind)
    s.append(b"bye", kind="bye", keep=True)
    record = sp.RECORD_OVERHEAD + 16
    for gone in range(1, len(sp.DROP_ORDER) + 1):
        s.compact(s.size - record)  # room for one record less
        left = [sp.KIND_NAMES[t & 0x0F] for _, t, _ in s.read_from(sp.HEADER_SIZE)]
        assert left == ["hello", *reversed(sp.DROP_ORDER[gone:]), "bye"]
    s.close()


def test_the_docs_tell_the_drop_order_of_a_full_spool():
    page = Path(__file__).parents[2] / "docs" / "distributed.md"
    readme = " ".join(page.read_text().split())
    kinds = [f"{kind}s" for kind in sp.DROP_ORDER]
    said = f"a full spool drops {kinds[0]} first, then {', '.join(kinds[1:-1])} and {kinds[-1]}"
    assert said in readme
