"""Our pages in a real headless browser: Debian's chromium driven by Playwright (never a download).

The ``browser`` fixture (tests/conftest.py) launches it. :class:`RecordedPage` opens a page
from file:// keeping every console error, page error, request and dialog, with every request
outside file:/data:/about:/blob: aborted.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
#: The flags a root process on a closed network needs (no background requests, no sandbox).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOCAL = ("file:", "data:", "about:", "blob:")
needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="no Chromium installed (apt-get install chromium); .ci/run installs it")


class RecordedPage:
    """``path`` opened in ``browser``, waited on until ``ready`` (a JS expression) holds."""

    def __init__(self, browser: Any, path: Path, *, ready: str, width: int, height: int,
                 timeout_ms: int = 20000) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page = page = browser.new_page(viewport={"width": width, "height": height}, device_scale_factor=1)
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(LOCAL) else r.abort())
        page.goto(path.as_uri())
        page.wait_for_function(ready, timeout=timeout_ms)

    def foreign(self) -> list[str]:
        """The requests that left the page's own files."""
        return [u for u in self.requests if not u.startswith(LOCAL)]
