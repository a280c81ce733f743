"""The wire's table of message kinds is the one list: the agent's spool, the
server's backlog and the server's writer each derive what they need from it,
so a new kind is a row in nand/wire/kinds.py and its handlers."""

from __future__ import annotations

import pytest

from nand import wire
from nand.errors import WireError
from nand.wire.kinds import BY_NAME, KINDS, SPOOL_DROP_ORDER, VERDICT_FIRST


def test_every_kind_has_one_row_and_every_agent_kind_a_code_the_spool_can_hold() -> None:
    names = [kind.name for kind in KINDS]
    assert len(names) == len(set(names))
    codes = [kind.code for kind in KINDS if kind.sender == "agent"]
    assert len(codes) == len(set(codes)) and all(1 <= c <= 15 for c in codes)
    assert all(kind.code == 0 for kind in KINDS if kind.sender == "server")
    # on disk since the spool's version 1: these codes never change
    assert {k: BY_NAME[k].code for k in wire.AGENT_KINDS[:7]} == {
        "hello": 1,
        "event": 2,
        "heartbeat": 3,
        "flight": 4,
        "bye": 5,
        "fingerprint": 6,
        "warning": 7,
    }


def test_the_spool_takes_its_codes_and_drop_order_from_the_table() -> None:
    from nand.agent.transport import spool

    agent_kinds = {kind.name for kind in KINDS if kind.sender == "agent"}
    assert {name: BY_NAME[name].code for name in agent_kinds} == spool.KIND_CODES
    assert spool.DROP_ORDER == SPOOL_DROP_ORDER
    ranks = [BY_NAME[name].spool_drop for name in spool.DROP_ORDER]
    assert ranks == sorted(ranks)
    # heartbeats go first, the NaN itself last among what may go
    assert spool.DROP_ORDER[0] == "heartbeat" and spool.DROP_ORDER[-1] == "event"


def test_the_backlog_writes_first_what_the_table_says_decides_a_verdict() -> None:
    from nand.server.agents import backlog

    assert backlog.FIRST_KINDS == VERDICT_FIRST == {"event", "bye", "flight", "warning"}


def test_the_writer_has_a_handler_for_every_agent_kind_and_no_other() -> None:
    from nand.server.agents import stores

    handled = {kind for kind, _ in stores.UNLOCKED + stores.LOCKED}
    assert handled == set(wire.AGENT_KINDS)


def test_every_table_a_kind_is_stored_in_exists() -> None:
    from nand.server.storage.models import Base

    tables = set(Base.metadata.tables)
    for kind in KINDS:
        assert set(kind.stored_in) <= tables, kind.name
        assert bool(kind.stored_in) == (kind.sender == "agent"), kind.name


def test_decode_checks_every_kind_by_its_row() -> None:
    for kind in KINDS:
        with pytest.raises(WireError) as raised:
            wire.decode(wire.encode({"kind": kind.name}))
        assert raised.value.reason == "missing_field", kind.name
