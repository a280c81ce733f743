"""nand: find where a PyTorch training run first went non-finite.

>>> import nand
>>> with nand.watch(model, optimizer=opt) as watch:   # doctest: +SKIP
...     train(model, opt)
>>> watch.first                                        # doctest: +SKIP
Event(rank=0, step=4711, phase='forward', module='encoder.layers.5.fc2', ...)

The agent (``nand.watch``, ``nand.Watch``) needs the ``agent`` extra (torch);
it is imported on first use so that a server host never imports torch.
"""

import typing

from nand.errors import EarlyWarning, NandError, NonFiniteError, StopRequested
from nand.events import Alert, Event

__version__ = "0.1.0"

__all__ = [
    "Alert",
    "EarlyWarning",
    "Event",
    "NandError",
    "NonFiniteError",
    "StopRequested",
    "Watch",
    "__version__",
    "watch",
]

if typing.TYPE_CHECKING:
    from nand.agent.api import Watch, watch


def __getattr__(name: str) -> typing.Any:
    # Lazy: importing nand must not import torch (server hosts do not have it).
    if name in ("watch", "Watch"):
        try:
            from nand.agent import api
        except ImportError as exc:
            raise ImportError(
                f"nand.{name} needs PyTorch: pip install 'nand[agent]' ({exc})"
            ) from exc
        return getattr(api, name)
    raise AttributeError(f"module 'nand' has no attribute {name!r}")
