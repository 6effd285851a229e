"""The repository stands alone: its code, docs and scripts cite no file outside it (no design
card kept elsewhere, no path of one machine) and name work by what it is, never by a tracker's
internal number that means nothing to a reader."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".sh", ".rs", ".toml", ".txt", ".yml", ".yaml", ".cfg"}
PLACES = ["python", "tests", "benches", "docs", "tools", "examples", "rust/src", ".ci"]
# built from pieces so that this file does not match itself
OUTSIDE = re.compile("|".join([r"DESIGN" + r"\.md", r"/" + r"work/", r"shared" + r"/peers", r"peer_" + r"wheels"]))
ISSUE_NUMBER = re.compile(r"\b(issue|item|ticket)s? #?\d+\b", re.IGNORECASE)


def _files() -> list[Path]:
    files = [p for p in ROOT.iterdir() if p.is_file() and (p.suffix in TEXT or p.name == "Makefile")]
    for place in PLACES:
        files += [p for p in (ROOT / place).rglob("*") if p.is_file() and p.suffix in TEXT]
    return [p for p in files if "__pycache__" not in p.parts]


def test_no_file_cites_what_lies_outside_the_repository_or_an_issue_number():
    found = []
    for path in _files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) or ISSUE_NUMBER.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert len(_files()) > 100  # the walk found the repository
    assert not found, "\n".join(found)
