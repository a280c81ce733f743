"""nand: find where a PyTorch training run first went non-finite.

>>> import nand
>>> with nand.watch(model, optimizer=opt) as watch:   # doctest: +SKIP
...     train(model, opt)
>>> watch.first                                        # doctest: +SKIP
Event(rank=0, step=4711, phase='forward', module='encoder.layers.5.fc2', ...)

The agent (``nand.watch``, ``nand.Watch``) needs the ``agent`` extra (torch);
it is imported on first use so that a server host never imports torch. An
installed torch older than nand supports is said in one line at import
(:mod:`nand.torch_support`, read from torch's metadata without importing it).
"""

import importlib.util
import logging
import typing

from nand import torch_support
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

_TORCH_TOO_OLD = torch_support.too_old(torch_support.installed_torch())
if _TORCH_TOO_OLD is not None:
    logging.getLogger("nand").warning(_TORCH_TOO_OLD)

if typing.TYPE_CHECKING:
    from nand.agent.api import Watch, watch


def __getattr__(name: str) -> typing.Any:
    # Lazy: importing nand must not import torch (server hosts do not have it).
    if name in ("watch", "Watch"):
        try:
            from nand.agent import api
        except ImportError as exc:
            if importlib.util.find_spec("torch") is not None:
                raise  # torch is there: the error says what is wrong (too old, ...)
            raise ImportError(
                f"nand.{name} needs PyTorch: pip install 'nand-torch[agent]' ({exc})"
            ) from exc
        return getattr(api, name)
    raise AttributeError(f"module 'nand' has no attribute {name!r}")
