"""The server's settings, read once from the ``NAND_*`` environment (see :mod:`nand.config`).

>>> s = Settings(db_url="sqlite:///:memory:", token="secret")
>>> s.lost_after_s
60.0
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from nand import cadence, config
from nand.errors import ConfigError

#: Where all interfaces are bound: the machine may be reached by its name.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True)
class Settings:
    db_url: str = "sqlite:///nand.db"
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    #: Host names the REST API answers to besides IPs and localhost (nand.server.http.guard).
    allowed_hosts: tuple[str, ...] = ()
    zmq_bind: str = "tcp://127.0.0.1:5557"
    #: Shared secret; required from agents (hello) and for stop when set.
    token: str | None = None
    #: Z85 CURVE secret key: when set, agents must encrypt (CURVE server).
    curve_secret_key: str | None = None
    lost_after_s: float = 60.0
    stalled_after_s: float = 300.0
    #: The agents' heartbeat period, used by the stop-step rule.
    heartbeat_s: float = 5.0
    #: A rank whose local gradient norm is this many times off the ranks'
    #: median at a step gets a ``grad_outlier`` warning (nand.server.analysis.outliers).
    grad_outlier_factor: float = 10.0
    #: Most messages written in one transaction.
    max_batch: int = 2000
    #: How often the stream endpoint and the stop push look at the database.
    poll_s: float = 0.5
    #: The event streams summarise a run of more ranks than this without
    #: loading every rank (``rankpage.run_summary``): same summary, less memory.
    big_run_ranks: int = 256
    #: Largest accepted frame, in bytes.
    max_frame_bytes: int = 4 * 1024 * 1024
    #: Largest REST request body (a stop request is well under 1 KiB).
    max_body_bytes: int = 64 * 1024
    #: Most bytes of frames read from the ZeroMQ socket in one turn.
    max_batch_bytes: int = 64 * 1024 * 1024
    #: Agent bindings kept in memory (nand.server.agents.admission); older ones are
    #: looked up in the database again when their agent speaks. A job's ranks
    #: speak in turn, so a cache smaller than the job misses on every message:
    #: this covers a 100,000-rank job on one server (about 33 MB at 100,000).
    max_agents_cached: int = 131_072
    #: How long a server holds an agent id after last hearing it (nand.server.agents.leases).
    agent_lease_s: float = 15.0
    #: Where state changes are POSTed (nand.server.notify.notifier); none: not at all.
    notify_urls: tuple[str, ...] = ()
    notify_secret: str | None = None
    notify_timeout_s: float = 5.0
    #: How often the notifier looks for state changes and due deliveries: a
    #: sweep of 200 live runs of 8 ranks took ~0.1 s on a loaded 2-core host.
    notify_poll_s: float = 5.0
    #: The dashboard's address in notifications (``NAND_URL``); None: the bound one.
    public_url: str | None = None

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Settings from the environment; keyword arguments that are not None win."""
        values: dict[str, object] = {
            "db_url": config.get_str(config.NAND_DB, cls.db_url),
            "http_host": config.get_str(config.NAND_HTTP_HOST, cls.http_host),
            "http_port": config.get_int(config.NAND_HTTP_PORT, cls.http_port),
            "allowed_hosts": _names(config.get_str(config.NAND_ALLOWED_HOSTS)),
            "zmq_bind": config.get_str(config.NAND_ZMQ_BIND, cls.zmq_bind),
            "token": config.get_str(config.NAND_TOKEN),
            "curve_secret_key": config.get_str(config.NAND_CURVE_SECRET_KEY),
            "lost_after_s": config.get_float(config.NAND_LOST_AFTER_S, cls.lost_after_s),
            "stalled_after_s": config.get_float(config.NAND_STALLED_AFTER_S, cls.stalled_after_s),
            "heartbeat_s": config.get_float(config.NAND_HEARTBEAT_S, cls.heartbeat_s),
            "grad_outlier_factor": config.get_float(
                config.NAND_GRAD_OUTLIER_FACTOR, cls.grad_outlier_factor
            ),
            "agent_lease_s": config.get_float(config.NAND_AGENT_LEASE_S, cls.agent_lease_s),
            "notify_urls": _http_urls(config.NAND_NOTIFY_URL),
            "notify_secret": config.get_str(config.NAND_NOTIFY_SECRET),
            "notify_timeout_s": config.get_float(
                config.NAND_NOTIFY_TIMEOUT_S, cls.notify_timeout_s
            ),
            "public_url": config.get_str(config.NAND_URL),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    def for_world(self, world_size: int) -> Settings:
        """These settings for a job of ``world_size`` ranks: a big job's ranks report
        less often (:mod:`nand.cadence`), so silence and stalls count from the
        same stretched period.

        >>> Settings().for_world(100_000).lost_after_s
        600.0
        """
        factor = cadence.stretch(self.heartbeat_s, world_size)
        if factor == 1.0:
            return self
        return replace(
            self,
            lost_after_s=self.lost_after_s * factor,
            stalled_after_s=self.stalled_after_s * factor,
            heartbeat_s=self.heartbeat_s * factor,
        )


def _names(text: str | None, separators: str = ",") -> tuple[str, ...]:
    """``"a, b,,c"`` → ``("a", "b", "c")``; ``separators``: each character splits."""
    for separator in separators[1:]:
        text = (text or "").replace(separator, separators[0])
    return tuple(name.strip() for name in (text or "").split(separators[0]) if name.strip())


def _http_urls(name: str) -> tuple[str, ...]:
    """The URLs in variable ``name`` (spaces or commas between), each http(s)."""
    urls = _names(config.get_str(name), " ,")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{name}: {url!r} is not an http:// or https:// URL")
    return urls
