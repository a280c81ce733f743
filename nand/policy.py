"""``on_nonfinite``: what a rank does with a non-finite step, as one enum.

Users pass a string (``nand.watch(on_nonfinite="stop")``, ``NAND_ON_NONFINITE``);
:class:`~nand.config.AgentConfig` turns it into an :class:`OnNonfinite` once,
refusing a value it does not know. Every place that acts on the policy asks
one of its properties (``raises``, ``reads_in_sync``, …) instead of comparing
strings, so what each policy means is written here and nowhere else. How the
agent applies it at the step boundary: ``nand.agent.step.policy``.

It is a :class:`~enum.StrEnum`: it equals, formats and serialises as its
string (``OnNonfinite.STOP == "stop"``), so logs, the hello message and code
that compares with a string see what they saw before.

>>> OnNonfinite.parse("stop").agrees_across_ranks
True
>>> OnNonfinite.parse("explode")
Traceback (most recent call last):
...
nand.errors.ConfigError: on_nonfinite='explode': use one of warn, raise, skip, stop
"""

from __future__ import annotations

from enum import StrEnum

from nand.errors import ConfigError


class OnNonfinite(StrEnum):
    #: Log the incident (and send it) and go on.
    WARN = "warn"
    #: Raise ``nand.NonFiniteError`` at the step boundary, before the update.
    RAISE = "raise"
    #: Drop this optimizer step so the weights stay finite, and go on.
    SKIP = "skip"
    #: Raise at a step boundary agreed by every rank.
    STOP = "stop"

    @classmethod
    def parse(cls, value: str | OnNonfinite) -> OnNonfinite:
        """The policy named ``value``; :class:`ConfigError` naming the choices if none is."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(policy.value for policy in cls)
            raise ConfigError(f"on_nonfinite={value!r}: use one of {choices}") from None

    @property
    def raises(self) -> bool:
        """A non-finite step ends training (an error out of ``optimizer.step``)."""
        return self in (OnNonfinite.RAISE, OnNonfinite.STOP)

    @property
    def reads_in_sync(self) -> bool:
        """The decision is taken on the host before the update, so the step's
        window is read at its own boundary, never one step late."""
        return self.raises

    @property
    def skips_update(self) -> bool:
        """A non-finite step's update is dropped and training goes on."""
        return self is OnNonfinite.SKIP

    @property
    def agrees_across_ranks(self) -> bool:
        """Every rank acts on the same steps: the non-finite flag is all-reduced
        at each boundary (``skip`` keeps replicas equal, ``stop`` ends them together)."""
        return self in (OnNonfinite.SKIP, OnNonfinite.STOP)

    @property
    def acts(self) -> bool:
        """Anything beyond logging and sending the incident (all but ``warn``)."""
        return self is not OnNonfinite.WARN
