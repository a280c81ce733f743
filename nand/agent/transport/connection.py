"""The agent's ZeroMQ socket: a DEALER connected to the server's ROUTER.

Shared by the sender thread and ``nand spool replay``. Options, and why:

- ``LINGER 0``: closing never waits for the network (unsent frames are in the
  spool or will be resent; nothing relies on ZeroMQ's own queue at exit);
- ``IMMEDIATE 1`` (sender): frames are queued only to a connection whose
  handshake completed, so a send while the server is away fails at once
  (``zmq.Again``) and the frame goes to the spool instead of a dead pipe;
- ``SNDHWM``: bounds what ZeroMQ holds besides the agent's own window;
- ``HEARTBEAT_*``: a server that vanished without closing the TCP connection
  (a network partition) is noticed within seconds;
- CURVE: with the server's public key the agent makes up its own key pair,
  and the connection is encrypted and the server authenticated.
"""

from __future__ import annotations

from typing import Any

import zmq


def dealer(
    ctx: zmq.Context[Any],
    endpoint: str,
    *,
    curve_server_key: str | None = None,
    immediate: bool = False,
    sndhwm: int = 1000,
) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    for option, value in (
        (zmq.LINGER, 0),
        (zmq.IMMEDIATE, int(immediate)),
        (zmq.SNDHWM, sndhwm),
        (zmq.RCVHWM, 10_000),
        (zmq.RECONNECT_IVL, 100),
        (zmq.RECONNECT_IVL_MAX, 2000),
        (zmq.HEARTBEAT_IVL, 2000),
        (zmq.HEARTBEAT_TIMEOUT, 6000),
    ):
        sock.setsockopt(option, value)
    if curve_server_key:
        public, secret = zmq.curve_keypair()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = curve_server_key.encode()
    return sock
