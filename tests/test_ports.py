"""The ports tests and benchmarks start servers on: outside the range the kernel
takes outgoing connections' local ports from, so none is taken before its server binds."""

from __future__ import annotations

import random
import socket

from nand.testing import free_port


def ephemeral_range() -> range:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(n) for n in f.read().split())
    return range(low, high + 1)


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    ephemeral = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert not [p for p in ports if p in ephemeral]
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_workers_that_seeded_random_alike_still_get_different_ports() -> None:
    random.seed(0)
    first = [free_port() for _ in range(5)]
    random.seed(0)
    assert [free_port() for _ in range(5)] != first


def test_a_port_in_use_is_not_given() -> None:
    held = []
    for _ in range(20):
        s = socket.socket()
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        held.append(s)
    taken = {s.getsockname()[1] for s in held}
    try:
        assert not taken & {free_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()
