"""The README's picture of the report (docs/img/report.png): the top of a finished run's HTML report,
taken by headless Chromium, the browser the report's rendering test uses (tests/test_report.py).

    .venv/bin/snakemake --profile profiles/default          # the default demo, if it has not run
    .venv/bin/python docs/img/screenshot.py results/report/chexflow_report.html docs/img/report.png

Chromium comes with `bash envs/setup.sh --test` (Debian's `chromium`). The PNG is written under a
temporary name and renamed, so an interrupted run never leaves half a picture.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

CHROMIUM = "/usr/bin/chromium"
WIDTH, HEIGHT = 1100, 1300     # CSS pixels: the banner, the run summary and the start of the AUROC table


class ScreenshotError(RuntimeError):
    """Chromium is missing, failed, or wrote no picture of the expected size; the message says which."""


def chromium_command(chromium: str, html: Path, png: Path, profile: Path, width: int, height: int) -> list[str]:
    """One headless Chromium run that renders ``html`` into ``png`` at width x height, offline."""
    return [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
            "--force-device-scale-factor=1", f"--user-data-dir={profile}", f"--window-size={width},{height}",
            f"--screenshot={png}", html.resolve().as_uri()]


def screenshot(html: Path, png: Path, *, width: int = WIDTH, height: int = HEIGHT, chromium: str = CHROMIUM,
               timeout: float = 180) -> Path:
    """Render ``html`` with headless Chromium and write the picture to ``png`` (a palette PNG, small enough
    to commit); returns ``png``."""
    if not Path(html).is_file():
        raise ScreenshotError(f"{html}: no such report (run the workflow first)")
    if not Path(chromium).is_file():
        raise ScreenshotError(f"{chromium}: Chromium is not installed (bash envs/setup.sh --test)")
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chexflow-shot-") as tmp:
        shot = Path(tmp) / "shot.png"
        proc = subprocess.run(chromium_command(chromium, Path(html), shot, Path(tmp) / "profile", width, height),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not shot.is_file():
            raise ScreenshotError(f"{chromium} failed on {html} (exit {proc.returncode}): {proc.stderr[-2000:]}")
        with Image.open(shot) as im:
            if im.size != (width, height):
                raise ScreenshotError(f"{shot}: Chromium wrote {im.size[0]}x{im.size[1]}, expected {width}x{height}")
            small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        part = png.with_name(f".{png.name}.part")
        small.save(part, format="PNG", optimize=True)
        os.replace(part, png)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html", type=Path, help="a finished run's results/report/chexflow_report.html")
    ap.add_argument("png", type=Path, help="where to write the picture, e.g. docs/img/report.png")
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--height", type=int, default=HEIGHT)
    ap.add_argument("--chromium", default=CHROMIUM)
    args = ap.parse_args(argv)
    try:
        out = screenshot(args.html, args.png, width=args.width, height=args.height, chromium=args.chromium)
    except ScreenshotError as exc:
        print(f"screenshot: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
