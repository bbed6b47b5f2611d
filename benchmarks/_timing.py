"""The benchmarks' one shared helper: common command-line options, start-up, timing, JSON output.

Every ``benchmarks/*.py`` declares its flags with :func:`parser` (keyword defaults become ``--kebab-case``
options; the common ones, ``threads``, ``repeats``, ``warmup``, ``device``, ``dtype``, ``out``, get one help
text), starts with :func:`start` (torch threads and seed), times with :func:`time_interleaved` (medians of
interleaved repeats) or :func:`time_once` (one run), and writes its JSON with :func:`write` / :func:`write_json`.
"""

from __future__ import annotations

import argparse
import importlib.util
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

# help of the options several benchmarks share
COMMON_HELP = {
    "threads": "torch CPU threads (torch.set_num_threads)",
    "repeats": "timed repeats of each variant, interleaved; medians reported",
    "warmup": "untimed warm-up runs of each variant",
    "device": "torch device of the timed runs (cpu, cuda)",
    "dtype": "torch dtype name (float32, bfloat16, ...)",
    "out": "output JSON path",
}


def arg(default: Any = None, help: str | None = None, **kw: Any) -> dict[str, Any]:
    """One option for :func:`parser` when a bare default is not enough: ``arg(None, type=int)``,
    ``arg(0.0, "what it does")``, ``arg(nargs="+", type=int, default=[1, 2])``. The type is the default's."""
    spec: dict[str, Any] = {"default": default, **kw}
    if help is not None:
        spec["help"] = help
    if isinstance(default, bool) and "action" not in kw:
        spec["action"] = "store_false" if default else "store_true"
    elif default is not None and "type" not in kw and "action" not in kw:
        spec["type"] = type(default[0]) if isinstance(default, list) else type(default)
    return spec


def parser(doc: str | None = None, **options: Any) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` (description: the first line of ``doc``) with one ``--name-with-dashes`` option
    per keyword: a bare value is the default (its type the option's type; ``False`` a flag), an :func:`arg`
    dict is passed to ``add_argument``. ``parser(__doc__, threads=1, repeats=7, seq=256)``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0] if doc else None)
    for name, value in options.items():
        spec = value if isinstance(value, dict) else arg(value)
        if "help" not in spec and name in COMMON_HELP:
            spec = {**spec, "help": COMMON_HELP[name]}
        p.add_argument("--" + name.replace("_", "-"), **spec)
    return p


def start(args: argparse.Namespace | None = None, *, seed: int | None = 0, threads: int | None = None) -> float:
    """A benchmark's common start: torch CPU threads (``args.threads`` if the script has ``--threads``, else
    ``threads``; unchanged if neither), ``torch.manual_seed(seed)`` (unless ``None``). Returns the
    ``time.perf_counter()`` start for wall times."""
    n = getattr(args, "threads", None) if args is not None else None
    n = threads if n is None else n
    if n is not None:
        torch.set_num_threads(n)
    if seed is not None:
        torch.manual_seed(seed)
    return time.perf_counter()


def command(env: str = "") -> str:
    """How the benchmark was launched, for its JSON: ``[env ]python -m benchmarks.<name> <args...>`` (a
    script of this folder; ``python <argv...>`` for anything else)."""
    first = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if first is not None and first.suffix == ".py" and first.resolve().parent == Path(__file__).resolve().parent:
        launched = ["-m", f"benchmarks.{first.stem}", *sys.argv[1:]]
    else:
        launched = sys.argv
    return (f"{env} " if env else "") + "python " + " ".join(launched)


def script(name: str) -> ModuleType:
    """Import the repository script ``scripts/{name}.py`` (not part of the package), e.g. the embedded
    model's builder ``script("tinymodel")``), loaded from its file (``sys.path`` untouched) once per process."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def embedded(seed: int | None = 0) -> tuple[Any, Any]:
    """Seeded, the embedded tinyshakespeare model (nnsight, offline) and its packaged Lorsa (layer 2)."""
    from nnsight_lorsa import LorsaSet
    from nnsight_lorsa.assets import default_lorsa_dir
    from nnsight_lorsa.envoy import load_model

    start(seed=seed)
    model = load_model()
    return model, LorsaSet.from_pretrained(model, default_lorsa_dir())


def time_once(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds)`` of one run (for what is too slow to repeat)."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int = 7, warmup: int = 2) -> dict[str, dict]:
    """Median wall time of each fn; runs are interleaved (a, b, a, b, ...) so noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_once(fn)[1])
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "runs": len(v)} for k, v in times.items()}


def profile_table(fn: Callable[[], Any], dev: torch.device, runs: int = 3, top: int = 20,
                  warmup: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Where ``fn``'s time goes operator by operator under ``torch.profiler``: ``{"device": ..., "cpu": ...}``,
    the ``top`` operators by self device time (CUDA kernels and the ops that launch them; ``[]`` on a CPU) and by
    self CPU time (host work: Python-side bookkeeping shows as the ops it calls), each
    ``[{"name", "calls", "device_ms", "cpu_ms"}]`` per call of ``fn`` (``runs`` calls profiled, one unprofiled call
    first unless ``warmup`` is False). The device synchronised after the calls."""
    from torch.profiler import ProfilerActivity, profile

    def synced() -> None:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    cuda = dev.type == "cuda"
    if warmup:
        synced()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(runs):
            synced()
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        rows.append({"name": e.key, "calls": e.count / runs, "device_ms": device_us / 1e3 / runs,
                     "cpu_ms": e.self_cpu_time_total / 1e3 / runs})
    by_device = sorted((r for r in rows if r["device_ms"] > 0), key=lambda r: r["device_ms"], reverse=True)
    return {"device": by_device[:top] if cuda else [],
            "cpu": sorted(rows, key=lambda r: r["cpu_ms"], reverse=True)[:top]}


def environment() -> dict[str, Any]:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "processor": platform.processor(), "cuda": torch.cuda.is_available()}


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """``payload`` as indented JSON at ``path`` (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def write(name: str, payload: dict[str, Any]) -> Path:
    """``results/{name}.json``: ``payload`` plus the ``environment`` (torch version, threads, machine)."""
    return write_json(RESULTS / f"{name}.json", {**payload, "environment": environment()})


def table(rows: list[tuple], header: tuple) -> str:
    cols = list(zip(header, *rows, strict=True))
    widths = [max(len(str(c)) for c in col) for col in cols]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])
