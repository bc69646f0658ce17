"""spec/errors.md lists every ErrorCode once, with the severity the code has; spec/README.md
indexes every spec page."""

from __future__ import annotations

import re
from pathlib import Path

from yeto_proto import ErrorCode

SPEC = Path(__file__).resolve().parent.parent / "spec"
ROW = re.compile(r"^\|\s*`([A-Z0-9_]+)`\s*\|\s*(fatal|rejected)\s*\|\s*(.+?)\s*\|\s*$")


def _rows() -> list[tuple[str, str, str]]:
    text = (SPEC / "errors.md").read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows.append((match.group(1), match.group(2), match.group(3)))
    return rows


def test_every_error_code_is_documented_exactly_once() -> None:
    documented = [name for name, _, _ in _rows()]
    missing = sorted({c.name for c in ErrorCode} - set(documented))
    assert not missing, f"spec/errors.md lacks a row for: {', '.join(missing)}"
    unknown = sorted(set(documented) - {c.name for c in ErrorCode})
    assert not unknown, f"spec/errors.md documents codes that do not exist: {unknown}"
    repeated = sorted({n for n in documented if documented.count(n) > 1})
    assert not repeated, f"spec/errors.md documents these twice: {repeated}"


def test_documented_severity_matches_the_code() -> None:
    for name, severity, meaning in _rows():
        assert ErrorCode[name].severity.value == severity, name
        assert len(meaning) > 10, f"{name} needs a meaning"


def test_every_spec_page_is_in_the_index() -> None:
    index = (SPEC / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in SPEC.glob("*.md") if p.name != "README.md")
    assert pages, "no spec pages found"
    unlisted = [page for page in pages if f"]({page})" not in index]
    assert not unlisted, f"spec/README.md does not link: {unlisted}"
