"""The dashboard speaks the event model's vocabulary, every word of it.

The phases, causes, states, relations and drop reasons are written once, in nand/events.py;
the dashboard's words for them are looked up by those names. A word missing
here would show the raw name, or nothing, on a real run.
"""

from __future__ import annotations

import pytest

from nand.events import CAUSES, DROP_REASONS, PHASES, RANK_STATES, RELATIONS, RUN_STATES
from tests.web.conftest import Dashboard
from tests.web.test_modules import call

pytestmark = pytest.mark.slow


def keys(page, module: str, name: str) -> set[str]:
    return set(call(page, module, f"Object.keys(m.{name})"))


def test_every_phase_cause_state_and_relation_has_its_words(page, dashboard: Dashboard) -> None:
    page.goto(dashboard.url)
    assert keys(page, "verdict.js", "PHASE_WORDS") == set(PHASES)
    assert keys(page, "verdict.js", "CAUSE_WORDS") == set(CAUSES)
    assert keys(page, "strip.js", "RELATION_WORDS") == set(RELATIONS)
    assert keys(page, "badges.js", "STATE_WORDS") == set(RUN_STATES) | set(RANK_STATES)
    assert set(call(page, "badges.js", "m.RUN_STATES")) == set(RUN_STATES)
    assert keys(page, "gaps.js", "REASON_WORDS") == set(DROP_REASONS)
