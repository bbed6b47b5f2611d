"""Shared timing helpers for the benchmarks: interleaved repeats, medians, JSON output."""

from __future__ import annotations

import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def script(name: str) -> ModuleType:
    """Import the repository script ``scripts/{name}.py`` (not part of the package), e.g. the embedded
    model's builder ``script("tinymodel")``."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int = 7, warmup: int = 2) -> dict[str, dict]:
    """Median wall time of each fn; runs are interleaved (a, b, a, b, ...) so noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "runs": len(v)} for k, v in times.items()}


def environment() -> dict[str, Any]:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "processor": platform.processor(), "cuda": torch.cuda.is_available()}


def write(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**payload, "environment": environment()}, indent=1))
    return path


def table(rows: list[tuple], header: tuple) -> str:
    cols = list(zip(header, *rows, strict=True))
    widths = [max(len(str(c)) for c in col) for col in cols]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])
