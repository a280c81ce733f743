"""The in-process agent: runs inside each training rank.

The data path, one package per stage, each importing only those before it:

- ``transport``: delivery to the server from a background thread;
- ``output``: the session and its sinks (log, JSONL file, server);
- ``detect``: hooks and probes, device-side reductions, no sync;
- ``step``: the one host read per step, the analysis, the event;
- ``watch``: :func:`nand.watch`, which wires them together.

``identity`` (who this rank is), ``sink`` (what a sink does) and ``safety``
(nand's own errors never reach training) are shared by all.
"""

from nand import torch_support

_too_old = torch_support.too_old(torch_support.installed_torch())
if _too_old is not None:
    raise ImportError(_too_old)
