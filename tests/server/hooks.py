"""The webhook receiver (``webhook.py``) as a process, and reading what it got."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from nand.testing import free_port

SCRIPT = Path(__file__).with_name("webhook.py")


class WebhookProcess:
    """``webhook.py`` on a fixed port (so it can go down and come back on it)."""

    def __init__(self, folder: Path, *, delay: float = 0.0, port: int | None = None) -> None:
        self.port = port or free_port()
        self.delay = delay
        self.out = folder / f"webhook-{self.port}.jsonl"
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/nand"

    def start(self) -> WebhookProcess:
        command = [sys.executable, str(SCRIPT), "--port", str(self.port), "--out", str(self.out)]
        command += ["--delay", str(self.delay)]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening"):
            raise RuntimeError(f"the webhook receiver did not start (exit {self.proc.poll()})")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def requests(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]

    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(request["body"]) for request in self.requests()]


def signed_correctly(request: dict[str, Any], secret: str) -> bool:
    """Whether the request's signature header is the HMAC-SHA256 of its body,
    computed here from the documented recipe (not with nand's own function)."""
    expected = hmac.new(secret.encode(), request["body"].encode(), hashlib.sha256).hexdigest()
    headers = {k.lower(): v for k, v in request["headers"].items()}
    return hmac.compare_digest(headers.get("x-nand-signature-256", ""), f"sha256={expected}")
