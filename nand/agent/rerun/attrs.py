"""The plain values a forward reads besides its inputs, held per micro-step.

A forward may depend on plain Python attributes of its modules that change
between calls: a counter the forward keeps of its own calls, a flag the
training loop sets before a call. A replay runs after they changed (at the
step's boundary; without an optimizer, at the next call of the model), so
it would run another forward than the one it repeats.

Each root call takes a shallow copy of the ``__dict__`` of each module whose
class is not torch's own (torch's modules keep such values fixed while
training): one dict copy per module, nothing walked, in one C loop (the
dicts are found once, by :func:`own_dicts`). The replay sets the
values of a plain immutable type (:data:`PLAIN`) that changed since, and
puts back those of now afterwards. Anything else (a tensor, an iterator the
forward consumes) is left as it is now.
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: The types of the values a replay sets back (immutable: a reference is the value).
PLAIN = (bool, int, float, str, type(None))
#: Attributes held: (the modules' live ``__dict__`` s, a shallow copy of each).
HeldAttrs = tuple[list[dict[str, Any]], list[dict[str, Any]]]
_copy = dict.copy


def own_dicts(root: nn.Module) -> list[dict[str, Any]]:
    """The ``__dict__`` of each module whose class is not torch's: the user's, a library's."""
    return [vars(m) for m in root.modules() if not type(m).__module__.startswith("torch.")]


def take(dicts: list[dict[str, Any]]) -> HeldAttrs | None:
    """The attributes in ``dicts`` now (None: no such module)."""
    return (dicts, list(map(_copy, dicts))) if dicts else None


def put_back(held: HeldAttrs | None) -> list[tuple[dict[str, Any], str, Any]]:
    """Set the plain values held that changed since; returns how to undo it."""
    undo: list[tuple[dict[str, Any], str, Any]] = []
    if held is None:
        return undo
    for now, then in zip(*held, strict=True):
        for name, value in then.items():
            current = now.get(name, value)
            if current is not value and type(value) in PLAIN and type(current) in PLAIN:
                undo.append((now, name, current))
                now[name] = value
    return undo


def restore(changes: list[tuple[dict[str, Any], str, Any]]) -> None:
    """Put back the values :func:`put_back` replaced."""
    for now, name, value in changes:
        now[name] = value
