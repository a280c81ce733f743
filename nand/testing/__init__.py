"""Helpers for testing nand and code that uses it (a real ZeroMQ receiver)."""

from nand.testing.ports import free_endpoint, free_port
from nand.testing.receiver import Receiver

__all__ = ["Receiver", "free_endpoint", "free_port"]
