"""The dashboard's run page of a big run in Chromium: time to render, and paging.

    python benchmarks/ranks100k.py reads --db /tmp/r100k.db     # makes the run once
    python benchmarks/run_page.py --db /tmp/r100k.db             # then this

One ``nand server`` on the SQLite file; Debian's Chromium (``/usr/bin/chromium``)
through Playwright opens ``#/runs/wide``; prints the page's own render time
(``main[data-render-ms]``), the wall time until the pager shows, and the time
of each "Next ranks →" until the pager names the next page.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nand.testing import free_port  # noqa: E402
from tests.server.processes import ServerProcess  # noqa: E402
from tests.web.conftest import CHROMIUM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--run", default="wide")
    parser.add_argument("--pages", type=int, default=3)
    args = parser.parse_args()
    env = {"NAND_LOST_AFTER_S": "1e9", "NAND_STALLED_AFTER_S": "1e9"}
    server = ServerProcess(f"sqlite:///{args.db}", free_port(), **env).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM))
            page = browser.new_page()
            started = time.perf_counter()
            page.goto(f"{server.http_url}/#/runs/{args.run}")
            pager = page.locator(".rank-pager .page-status")
            expect(pager).to_contain_text("ranks 0–", timeout=300_000)
            shown = time.perf_counter() - started
            render = page.locator("main").get_attribute("data-render-ms")
            print(f"run page: pager shown after {shown:.1f} s; data-render-ms {render}")
            print(f"  {pager.text_content()}")
            for _ in range(args.pages):
                before = pager.text_content()
                started = time.perf_counter()
                page.get_by_role("button", name="Next ranks →").click()
                expect(pager).not_to_have_text(before or "", timeout=300_000)
                took = time.perf_counter() - started
                print(f"  next page in {took:.2f} s: {pager.text_content()}")
            browser.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
