"""What the peer-check scripts share: strict-JSON results and their work folders (standard library only: imported
by each check's ``_shared.py``, in our environment and in the peers' venvs alike)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(obj), indent=1) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def clear_work(work: Path, entries: Iterable[str]) -> None:
    """``work`` created, with ``entries`` (what a check writes there) removed; nothing else is touched."""
    work.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        path = work / entry
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
