"""docs/protocol.md's field lists are the field table's (r3srv.server.fields): for each peer request
class, the fields it says r3srv serves, serves beyond the peer's class and refuses are exactly those
the table and the request Structs serve and refuse (tests/data/peer_fields.json: the peers' fields)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from r3srv.server.fields import PEER_CLASSES, ROUTE_FIELDS

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs/protocol.md").read_text()
PEER_FIELDS = json.loads((ROOT / "tests/data/peer_fields.json").read_text())["classes"]
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tito": "/inference/v1/generate",
          "sglang": "/generate"}


def _section(route: str, nested: str | None, cls: str) -> str:
    head = f"### POST {ROUTES[route]}" + (f" — `{nested}` (`{cls}`)" if nested else f" (`{cls}`)") + "\n"
    assert head in DOC, f"docs/protocol.md has no section {head.strip()!r}"
    start = DOC.index(head)
    end = DOC.find("\n#", start + 1)
    return DOC[start:end if end >= 0 else None]


def _names(text: str) -> set[str]:
    """The `field` names of a list line, not those in its parenthesized remarks."""
    while True:
        stripped = re.sub(r"\([^()]*\)", "", text)
        if stripped == text:
            return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", text))
        text = stripped


def _lists(section: str) -> tuple[set[str], set[str], set[str]]:
    served, beyond, refused = set(), set(), set()
    in_refused = False
    for line in section.splitlines():
        if line.startswith("- served: "):
            served = _names(line)
        elif line.startswith("- served beyond the peer's class: "):
            beyond = _names(line)
        in_refused = line.startswith("- refused") or (in_refused and line.startswith("  - "))
        if in_refused and line.startswith("  - "):
            refused |= _names(line.partition(":")[0])
    return served, beyond, refused


@pytest.mark.parametrize(("route", "nested"), list(PEER_CLASSES))
def test_the_doc_lists_what_the_table_serves_and_refuses(route, nested):
    cls = PEER_CLASSES[route, nested]
    fields = ROUTE_FIELDS[route] if nested is None else ROUTE_FIELDS[route].nested[nested]
    peer = set(PEER_FIELDS[cls]["fields"])
    served, beyond, refused = _lists(_section(route, nested, cls))
    assert served == set(fields.served) & peer
    assert beyond == set(fields.served) - peer
    assert refused == set(fields.refused)
