"""The shared command line of the tools that draw a docs page's pictures
from the code (cp_, ulysses_, muon_, hsdp_, mla_pictures.py): print them, or
``--check PAGE``, which fails when a picture on the page is not what the
code draws now (the tests run it, so a page cannot go stale)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def check(doc: Path, pictures: dict, tool: str) -> int:
    """1 (and a line per picture) when ``doc`` lacks one of ``pictures`` as a fenced block."""
    text = doc.read_text()
    missing = [name for name, pic in pictures.items() if f"```\n{pic}\n```" not in text]
    for name in missing:
        print(f"{doc}: the {name} picture differs from what the code draws now; rerun {tool}")
    return 1 if missing else 0


def main(doc: str, pictures, tool: str) -> None:
    """``tool [--check PAGE]``: ``pictures()`` gives {name: picture}."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--check", type=Path, default=None)
    a = ap.parse_args()
    if a.check:
        sys.exit(check(a.check, pictures(), tool))
    for name, pic in pictures().items():
        print(f"[{name}]\n```\n{pic}\n```\n")
