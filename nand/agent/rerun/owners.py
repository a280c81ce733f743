"""Which module made each autograd node of a replayed forward: :class:`NodeOwners`.

A backward op runs inside an autograd node, and the node was made by some
module's forward. Naming that module is exact where the order in which
gradients arrive is not: a value read by two consumers (``q``, ``k`` and
``v`` reading one norm's output, a shortcut beside a block) gets one
gradient, summed from both, and the probe that fires after it cannot say
which consumer's backward made it non-finite; nor can any probe of a first
layer, whose input gradient nothing reads.

During the replay's forward a hook after every module walks the graph back
from the module's outputs to its inputs and labels each node not labelled
yet with the module's name. Children return before their parent, so a node
belongs to the innermost module that made it, and the inline code of a
parent (between two children) to that parent. A gradient-checkpointed
forward recomputed inside the backward is labelled as it runs. The labels
hold the replay's graph until the replay ends (:meth:`NodeOwners.remove`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from nand.agent.detect.probes import iter_tensors


class NodeOwners:
    """Labels the nodes a replay's forward makes with their module's name."""

    def __init__(self, root: nn.Module, names: dict[nn.Module, str]) -> None:
        self._names = names
        self._owner: dict[Node, str] = {}
        self._handles: list[RemovableHandle] = [
            module.register_forward_hook(self._label, with_kwargs=True) for module in root.modules()
        ]

    def of(self, node: Node | None) -> str | None:
        """The module that made ``node`` (None: no module of the model did)."""
        return self._owner.get(node) if node is not None else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._owner.clear()

    def _label(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        name = self._names.get(module)
        if name is None:
            return
        inputs = {t.grad_fn for _, t in iter_tensors((args, kwargs)) if t.grad_fn is not None}
        todo = [t.grad_fn for _, t in iter_tensors(output) if t.grad_fn is not None]
        owner = self._owner
        while todo:
            node = todo.pop()
            if node in owner or node in inputs:
                continue  # a child's (labelled first), or where the module's inputs came from
            owner[node] = name
            todo.extend(after for after, _ in node.next_functions if after is not None)
