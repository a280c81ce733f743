"""The body of every refusal the API itself answers."""

from __future__ import annotations

from pydantic import BaseModel


class Problem(BaseModel):
    """Why a request was refused (every 4xx/5xx the API itself answers)."""

    detail: str
