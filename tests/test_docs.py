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
def test_doc_code_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    # the examples write their files under tempfile.mkdtemp() (and wandb its media): inside this test's folder,
    # removed with it (each run left ~10 folders in /tmp)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(BLOCK.findall(path.read_text())):
        try:
            filename = f"<doc {path.name} block {i}>"
            # nnsight reads a trace's with-block from its source: register it like a real file
            linecache.cache[filename] = (len(block), None, block.splitlines(keepends=True), filename)
            exec(compile(block, filename, "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{path.name}, python block {i} failed: {e!r}\n{block}") from e


def test_readme_and_docs_import_only_public_names():
    """Every ``from nnsight_lorsa… import name`` in a Python block of README/docs names a public name: one in
    the ``__all__`` of the top level or of the subpackage it is imported from (no module paths below that)."""
    import importlib
    import re

    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*[^\n]*\n(.*?)```", path.read_text(), re.S):  # python and shell heredocs
            for m in re.finditer(r"^\s*from (nnsight_lorsa[\w.]*) import ([^\n(#]*)", block, re.M):
                module = importlib.import_module(m.group(1))
                for name in (n.strip().split(" as ")[0] for n in m.group(2).split(",")):
                    if name and (m.group(1).count(".") > 1 or name not in getattr(module, "__all__", ())):
                        bad.append(f"{path.name}: from {m.group(1)} import {name}")
    assert not bad, bad

