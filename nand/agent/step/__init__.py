"""The step boundary: the one host read per step, and what it means.

``boundary`` reads the window the detectors filled; ``analysis`` finds the
first verified non-finite value when there is one; ``report`` turns it into
an :class:`nand.Event`; ``recorder`` keeps the last steps' figures (the
flight recorder).
"""
