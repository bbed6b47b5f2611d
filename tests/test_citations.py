"""Citations point at the papers' own sections or at repository docs (issue 22), never at documents that
are not in the repository (the project's seed papers by file number, its developer guide)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MISSING_DOCUMENT = re.compile(r"seed ?`*0[0-9]{2}|`*0[0-9]{2}_…|\bGUIDE\b", re.IGNORECASE)


def test_no_citation_of_a_document_outside_the_repository():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("nnsight_lorsa", "benchmarks", "tests", "scripts"):
        files += sorted((ROOT / folder).rglob("*.py"))
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in files if p != Path(__file__).resolve()
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if MISSING_DOCUMENT.search(line)]
    assert not bad, "\n".join(bad)
