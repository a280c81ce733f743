"""Helpers for testing nand and code that uses it (a real ZeroMQ receiver)."""

from nand.testing.receiver import Receiver

__all__ = ["Receiver"]
