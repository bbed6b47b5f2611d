"""Every ```python block of README.md and docs/*.md runs, in order, one namespace per file."""

from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("path", [d for d in DOCS if BLOCK.search(d.read_text())], ids=lambda p: p.name)
def test_doc_code_blocks_run(path: Path) -> None:
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(BLOCK.findall(path.read_text())):
        try:
            filename = f"<doc {path.name} block {i}>"
            # nnsight reads a trace's with-block from its source: register it like a real file
            linecache.cache[filename] = (len(block), None, block.splitlines(keepends=True), filename)
            exec(compile(block, filename, "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{path.name}, python block {i} failed: {e!r}\n{block}") from e
