"""benchmarks/RESULTS.md holds one section per benchmark; each run replaces only its own."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(heading: str, body: str, results: Path = RESULTS) -> None:
    """Write ``heading`` + ``body`` in place of that heading's section, or append it."""
    section = f"{heading}\n\n{body.strip()}\n"
    text = results.read_text(encoding="utf-8") if results.exists() else "# Benchmark results\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        following = text.find("\n## ", start + len(heading))
        rest = "" if following < 0 else text[following + 1 :]
        text = text[:start] + section + ("\n" + rest if rest else "")
    results.write_text(text, encoding="utf-8")
