"""Replay of a bad step, in process: the exact op, the source line, reproduced or not.

Not the spool's replay (``nand.agent.transport.replay``, which re-sends
messages): this runs a training step's forward and backward again.

- ``held``: what each micro-step keeps (input references, RNG and autocast
  state, the gradients that arrived at the model's outputs, the plain
  attributes of the model's own modules: ``attrs``);
- ``state``: what a replay changes and puts back (RNG, buffers, attributes,
  determinism);
- ``opwatch`` and ``source``: the dispatch mode that finds the op, and its line;
- ``run``: one replay; ``rerun``: when to replay and what the event says.
"""

from nand.agent.rerun.rerun import Rerun

__all__ = ["Rerun"]
