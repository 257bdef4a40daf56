#!/usr/bin/env python3
"""Screenshot the first screen of a release report (``ninfer-bench report ... --out DIR``) in headless Chromium.

    python3 scripts/screenshot_report.py DIR/report.html docs/perf/report-first-screen.png [--width 1366]
        [--height 900] [--max-kb 300]

Uses playwright when it is importable (with ``--chromium PATH`` or the first Chromium found as its browser), else
Chromium's own ``--headless --screenshot``. Neither is a dependency of the package (Debian: ``apt-get install
chromium``). A PNG over ``--max-kb`` is reduced to a 256-colour palette with Pillow where that is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium(given: str | None) -> str | None:
    if given:
        return given
    return next((path for name in CHROMIUMS if (path := shutil.which(name))), None)


def with_playwright(url: str, out: Path, width: int, height: int, chromium: str | None) -> bool:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return False
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(url)
        page.screenshot(path=str(out), full_page=False)
        browser.close()
    return True


def with_chromium(url: str, out: Path, width: int, height: int, chromium: str | None) -> None:
    if chromium is None:
        sys.exit("no Chromium found: apt-get install chromium (or pip install playwright), or pass --chromium PATH")
    with tempfile.TemporaryDirectory() as profile:  # a throwaway profile: no state left behind, no first-run dialogs
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={out}", url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode or not out.is_file():
        sys.exit(f"chromium failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def shrink(out: Path, max_kb: int) -> None:
    if out.stat().st_size <= max_kb * 1024:
        return
    try:
        from PIL import Image
    except ImportError:
        print(f"{out} is {out.stat().st_size // 1024} KB (over {max_kb}); install Pillow to reduce it")
        return
    with Image.open(out) as img:
        small = img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(out, optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--width", type=int, default=1366)
    ap.add_argument("--height", type=int, default=900)
    ap.add_argument("--max-kb", type=int, default=300)
    ap.add_argument("--chromium", default=None, help="Chromium executable [default: the first on PATH]")
    args = ap.parse_args()
    if not args.html.is_file():
        sys.exit(f"no such report: {args.html}")
    url = args.html.resolve().as_uri()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    chromium = find_chromium(args.chromium)
    if not with_playwright(url, args.png, args.width, args.height, chromium):
        with_chromium(url, args.png, args.width, args.height, chromium)
    shrink(args.png, args.max_kb)
    print(f"wrote {args.png} ({args.png.stat().st_size // 1024} KB, {args.width}x{args.height})")


if __name__ == "__main__":
    main()
