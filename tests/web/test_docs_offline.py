"""``/docs`` works offline: Swagger UI's script and styles come from the nand
server itself, so a browser that can reach nothing else still renders the API
reference (real Chromium, every request to another host refused)."""

from __future__ import annotations

import pytest

from tests.web.conftest import screenshot

pytestmark = pytest.mark.slow


def test_swagger_ui_renders_with_no_network_but_the_server(page, empty_server) -> None:
    base = empty_server.http_url
    elsewhere: list[str] = []

    def only_the_server(route) -> None:
        if route.request.url.startswith(base):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_server)
    page.goto(f"{base}/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "nand" in page.inner_text(".swagger-ui .info .title")
    page.get_by_text("/api/runs/{run}/verdict", exact=True).first.wait_for()
    screenshot(page, "docs-offline")
    assert elsewhere == [], f"/docs asked other hosts: {elsewhere}"
