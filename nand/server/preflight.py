"""What ``nand server`` and ``nand prune`` check before they start, each failure
a one-line :class:`~nand.errors.CommandError` that says what to do.

>>> parse_http("0.0.0.0:8080")
('0.0.0.0', 8080)
>>> parse_http("0.0.0.0:99999")  # doctest: +ELLIPSIS
Traceback (most recent call last):
nand.errors.CommandError: --http 0.0.0.0:99999: port 99999 is not in 0-65535; ...
>>> check_zmq_endpoint("5557")  # doctest: +ELLIPSIS
Traceback (most recent call last):
nand.errors.CommandError: --zmq 5557 is not a ZeroMQ endpoint; write it as tcp://HOST:PORT, ...
"""

from __future__ import annotations

import errno
import ipaddress
import re

from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from nand import exitcodes
from nand.errors import CommandError

DB_EXAMPLES = "sqlite:///nand.db or postgresql+psycopg://USER:PASSWORD@HOST/DB"
#: tcp://HOST:PORT (PORT may be * for any free one), or ipc:// / inproc:// paths.
_ZMQ_ENDPOINT = re.compile(r"tcp://(\[[^\]]+\]|[^:/\s]+):(\d+|\*)|(ipc|inproc)://\S+")


def parse_http(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise CommandError(
            f"--http {text} is not HOST:PORT; pass e.g. --http 127.0.0.1:8080",
            exitcodes.BAD_ADDRESS,
        )
    if int(port) > 65535:
        raise CommandError(
            f"--http {text}: port {port} is not in 0-65535; "
            f"pass e.g. --http {host or '0.0.0.0'}:8080",
            exitcodes.BAD_ADDRESS,
        )
    return host.strip("[]") or "127.0.0.1", int(port)


def check_zmq_endpoint(endpoint: str) -> None:
    match = _ZMQ_ENDPOINT.fullmatch(endpoint)
    if match is None:
        raise CommandError(
            f"--zmq {endpoint} is not a ZeroMQ endpoint; write it as tcp://HOST:PORT, "
            "e.g. --zmq tcp://127.0.0.1:5557",
            exitcodes.BAD_ADDRESS,
        )
    port = match.group(2)
    if port and port != "*" and int(port) > 65535:
        raise CommandError(
            f"--zmq {endpoint}: port {port} is not in 0-65535", exitcodes.BAD_ADDRESS
        )


def probe_zmq_bind(endpoint: str) -> None:
    """Bind the agents' endpoint once and let it go, so a taken port is said up front."""
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise bind_failed("ZeroMQ", "--zmq", endpoint, exc.errno, exc.strerror) from exc
    finally:
        sock.close(linger=0)
        context.term()


def bind_failed(what: str, flag: str, address: str, code: int | None, reason: str) -> CommandError:
    """The one line for a socket that would not bind."""
    if code == errno.EADDRINUSE:
        return CommandError(
            f"the {what} address {address} is already in use (another nand server?); "
            f"stop that process or pass another port with {flag}",
            exitcodes.ADDRESS_IN_USE,
        )
    return CommandError(
        f"cannot listen on {address} ({reason}); pass {flag} with an address of this machine, "
        f"e.g. 127.0.0.1 or 0.0.0.0",
        exitcodes.BAD_ADDRESS,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, or "*": reachable from elsewhere


def zmq_host(endpoint: str) -> str:
    match = _ZMQ_ENDPOINT.fullmatch(endpoint)
    return match.group(1) if match and match.group(1) else "127.0.0.1"


def check_db_url(text: str) -> URL:
    """The parsed URL, if nand can store into it; else why not and what to write."""
    try:
        url = make_url(text)
    except ArgumentError:
        raise CommandError(
            f"--db {text!r} is not a database URL; write {DB_EXAMPLES}",
            exitcodes.BAD_DATABASE_URL,
        ) from None
    # Not get_driver_name(): it loads the dialect, which fails for "postgres".
    backend, _, driver = url.drivername.partition("+")
    if backend in ("postgres", "postgresql") and driver != "psycopg":
        fixed = url.set(drivername="postgresql+psycopg").render_as_string(hide_password=True)
        raise CommandError(
            f"--db {url.drivername}://… needs the psycopg 3 driver spelled out: write {fixed}",
            exitcodes.BAD_DATABASE_URL,
        )
    if backend == "sqlite" and url.database in (None, "", ":memory:"):
        raise CommandError(
            f"--db {text} is an in-memory SQLite database, which the server's threads cannot "
            "share; give it a file, e.g. --db sqlite:///nand.db",
            exitcodes.BAD_DATABASE_URL,
        )
    if backend not in ("sqlite", "postgresql"):
        raise CommandError(
            f"--db {url.drivername}://…: nand stores into SQLite or PostgreSQL only; "
            f"write {DB_EXAMPLES}",
            exitcodes.BAD_DATABASE_URL,
        )
    return url


def open_database(text: str) -> Engine:
    """An engine on an up-to-date schema, or a CommandError saying why not."""
    from nand.server.storage.db import make_engine
    from nand.server.storage.migrate import upgrade

    url = check_db_url(text)
    try:
        engine = make_engine(text)
    except ModuleNotFoundError as exc:
        raise CommandError(
            f"the driver for {url.drivername} ({exc.name}) is not installed; "
            "pip install 'nand-torch[postgres]'",
            exitcodes.MISSING_EXTRA,
        ) from exc
    try:
        upgrade(engine)
    except DBAPIError as exc:
        engine.dispose()
        raise CommandError(_database_failure(url, exc), exitcodes.DATABASE_ERROR) from exc
    return engine


def _database_failure(url: URL, exc: DBAPIError) -> str:
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
    if url.get_backend_name() == "sqlite":
        return (
            f"cannot open the SQLite database {url.database} ({reason}); make sure its "
            "directory exists and is writable, or pass --db sqlite:///PATH/nand.db"
        )
    where = url.render_as_string(hide_password=True)
    return f"cannot use the database {where} ({reason}); check that it runs and the URL is right"
