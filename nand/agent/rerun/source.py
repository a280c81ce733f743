"""The user's source line of an aten op: ``path:line``.

Forward ops: the Python stack at the op, innermost first. Backward ops run
from the autograd engine, whose Python stack leads back to the replay, not
to the model; a backward node created under anomaly mode carries the stack
of the forward line that created it (``node.metadata["traceback_"]``, a list
of ``traceback.format_list`` entries, outermost first), and that is the line
given for it. A custom ``autograd.Function`` whose ``backward`` is user code
has that code on the stack: it wins.

"The user's" line: the innermost frame that is not torch's, not the standard
library's and not this dispatch mode's. The walk stops at any other frame of
nand (the demo's model, ``nand/demo``, is a user's code): what lies beyond is
the replay itself and the training loop that called ``optimizer.step()``,
not the code that made the value.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

import nand

#: torch's files and the standard library's (as ``os`` sees it and as sysconfig does)
_SKIPPED = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.__file__) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
)
_NAND = os.path.dirname(nand.__file__) + os.sep
#: The agent's own code, and the demo's model (which lives in nand too).
_AGENT = os.path.join(_NAND, "agent", "")
_DEMO = os.path.join(_NAND, "demo", "")
#: torch's frames between an op's caller and a dispatch mode (dynamo's disable wrapper).
_DISPATCH = tuple(
    os.path.join(os.path.dirname(torch.__file__), *part)
    for part in (("_dynamo", ""), ("_compile.py",), ("utils", "_python_dispatch.py"))
)
_TRACE_ENTRY = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_CALL_IMPL = nn.Module._call_impl.__code__


def _where(filename: str) -> bool | None:
    """True: the user's file; False: skip it; None: nand's, stop here (the
    demo's model and faults, ``nand/demo``, are a user's code)."""
    if filename.startswith(_NAND) and not filename.startswith(_DEMO):
        return None
    return not (filename.startswith("<") or filename.startswith(_SKIPPED))


def stack_source(frame: FrameType | None, own_file: str, outer: str = "") -> str:
    """The user's innermost line on the live stack from ``frame`` outwards
    (frames of ``own_file``, the dispatch mode's, are passed over). Without
    one (an op inside torch's own ``nn.Linear``, called by the replay): the
    ``outer`` line, where the user called what the replay calls (the model,
    a loss's function: :func:`calling_line`, held with the step); failing
    that, the innermost ``forward`` of torch's on the way."""
    inside = ""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != own_file:
            user = _where(filename)
            if user is None:
                return outer or inside
            if user:
                return f"{filename}:{frame.f_lineno}"
            if not inside and frame.f_code.co_name == "forward":
                inside = f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return inside


def calling_line(frame: FrameType | None) -> str:
    """The user's innermost line from ``frame`` outwards, passing over torch's,
    the standard library's and nand's own frames: where the user called the
    model or a torch function (held with a step, to be named in its replay)."""
    users = _USER_CODE
    while frame is not None:  # (this runs on every root call and recorded loss call)
        code = frame.f_code
        user = users.get(code)
        if user is None:
            user = users[code] = _is_users(code.co_filename)
        if user:
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


#: Whether a code object is the user's (see calling_line), by code object: a
#: dict lookup a frame rather than four prefix tests. (Code objects are as
#: many as the functions the program has; a dynamic ``exec`` may add some.)
_USER_CODE: dict[CodeType, bool] = {}


def _is_users(filename: str) -> bool:
    return filename.startswith(_DEMO) or not (
        filename.startswith(_NAND) or filename.startswith("<") or filename.startswith(_SKIPPED)
    )


def traceback_source(node: torch.autograd.graph.Node | None) -> str:
    """The user's forward line that created backward ``node`` (anomaly mode
    must have been on when it was created; otherwise "")."""
    if node is None:
        return ""
    metadata: dict[str, Any] = node.metadata  # type: ignore[assignment]  # (a dict, not a method)
    entries = metadata.get("traceback_") or ()
    for entry in reversed(entries):
        found = _TRACE_ENTRY.search(entry)
        if found is None:
            continue
        user = _where(found["file"])
        if user is None:
            return ""
        if user:
            return f"{found['file']}:{found['line']}"
    return ""


def innermost_module(frame: FrameType | None) -> nn.Module | None:
    """The module whose call is running at ``frame`` (its ``_call_impl`` frame)."""
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            return module if isinstance(module, nn.Module) else None
        frame = frame.f_back
    return None


def caller(depth: int) -> FrameType | None:
    return sys._getframe(depth + 1)


def nands(frame: FrameType | None, own_file: str) -> bool:
    """Whether the op at ``frame`` was called by nand's own code (passing over
    the dispatch machinery's frames and ``own_file``'s, the dispatch mode's):
    a probe reading a value the model made, not an op of the model."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != own_file and not filename.startswith(_DISPATCH):
            return filename.startswith(_AGENT)
        frame = frame.f_back
    return False
