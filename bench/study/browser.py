"""The report page in headless Chromium (Debian's `chromium`): how many
plots the laid-out page holds and how many of them were drawn, and a
screenshot for the docs.

    python -m study.browser PAGE.html SHOT.png    # writes the screenshot
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# As root, without a sandbox; no background connections (this machine
# reaches no Google host, and Chromium would try at every start).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    found = shutil.which("chromium")
    if not found:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    return found


def _run(page: Path, *extra: str) -> str:
    with tempfile.TemporaryDirectory(prefix="dmlc-chromium-") as profile:
        r = subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if r.returncode:
        raise RuntimeError(f"chromium failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


def plots_drawn(page: Path) -> tuple[int, int]:
    """(plots on the page, plots laid out with a size and drawn paths), as
    the page's own load handler counted them in the browser."""
    dom = _run(page, "--dump-dom")
    body = re.search(r"<body[^>]*>", dom)
    if not body:
        raise RuntimeError("chromium printed no <body>")
    attrs = dict(re.findall(r'data-([\w-]+)="(\d+)"', body.group(0)))
    if "plots" not in attrs:
        raise RuntimeError("the page's load handler did not run (no data-plots on <body>)")
    return int(attrs["plots"]), int(attrs.get("plots-drawn", "0"))


def screenshot(page: Path, png: Path, width: int = 1100, height: int = 2400) -> None:
    _run(page, f"--screenshot={png.resolve()}", f"--window-size={width},{height}")
    if not png.exists() or png.stat().st_size < 10_000:
        raise RuntimeError(f"chromium wrote no useful screenshot at {png}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m study.browser PAGE.html SHOT.png")
    screenshot(Path(sys.argv[1]), Path(sys.argv[2]))
