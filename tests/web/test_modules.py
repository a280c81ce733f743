"""The dashboard's small pure helpers, run in the browser as the pages load them."""

from __future__ import annotations

import pytest

from tests.web.conftest import Dashboard

pytestmark = pytest.mark.slow


def call(page, module: str, expression: str):
    """Evaluate `expression` with the dashboard's module bound to `m`."""
    source = f"async () => {{ const m = await import('/{module}'); return {expression}; }}"
    return page.evaluate(source)


def test_axis_ticks_are_round_numbers_and_at_least_three(page, dashboard: Dashboard) -> None:
    page.goto(dashboard.url)
    assert call(page, "scale.js", "m.niceTicks(7.6, 8.4, 4)") == [7.6, 7.8, 8, 8.2, 8.4]
    assert call(page, "scale.js", "m.niceTicks(0, 120, 6)") == [0, 20, 40, 60, 80, 100, 120]
    assert len(call(page, "scale.js", "m.niceTicks(1.9, 2.3, 5)")) >= 3
    assert call(page, "scale.js", "m.logValueTicks(0.8, 6)") == [1, 2, 5]
    assert call(page, "scale.js", "m.logValueTicks(1, 1e6, 4)") == [1, 100, 10000, 1000000]


def test_values_ranks_and_tensors_read_as_words(page, dashboard: Dashboard) -> None:
    page.goto(dashboard.url)
    assert call(page, "format.js", "m.rankList([0, 1, 2, 5, 7, 8])") == "0–2, 5, 7–8"
    assert call(page, "format.js", "m.valueKinds({nan: 12, posinf: 1})") == "NaN ×12 and +inf"
    assert call(page, "format.js", "m.valueKinds({})") == "a non-finite value"
    assert call(page, "format.js", "m.tensorLabel({shape: [4, 1024], dtype: 'float16'})") == (
        "4×1024 float16"
    )
    assert call(page, "format.js", "[m.num(65504), m.num(6.09e-5), m.num(0.5), m.num(null)]") == [
        "65,504",
        "6.09e-5",
        "0.5",
        "—",
    ]
    assert call(page, "format.js", "m.where('', 'TinyGPT')") == "the root module (TinyGPT)"
