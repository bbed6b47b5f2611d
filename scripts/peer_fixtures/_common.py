"""Helpers shared by the per-peer fixture scripts (run in a PEER's venv: torch + safetensors only,
never nnsight-lorsa). ``scripts/peer_fixtures/<peer>.py`` does ``sys.path.insert(0, its folder)`` and
imports this module."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

REFERENCE_FILE = "reference.safetensors"
REVERSE_DIR = "reverse"
REVERSE_RESULT = "result.json"
OURS_OUTPUTS = "ours_outputs.safetensors"


def fixed_inputs(d_in: int, n: int = 8, seed: int = 0) -> torch.Tensor:
    """``(n, d_in)`` float32 inputs from a seeded generator (stored with the outputs, so readers never
    need to reproduce the generator)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g)


def randomize_(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    """Overwrite every floating parameter and buffer with seeded random values (so zero-initialised
    biases and thresholds are exercised too)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point():
                t.copy_((torch.randn(t.shape, generator=g) * scale).to(t.dtype))


def save_reference(case_dir: Path, **tensors: torch.Tensor) -> None:
    """``case_dir/reference.safetensors`` (the inputs and the peer's own outputs)."""
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(case_dir / REFERENCE_FILE))


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max(max|b|, 1e-12)``."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def reverse_cases(out: Path) -> list[Path]:
    """The case folders our own ``save`` wrote under ``out/reverse`` (empty if none)."""
    d = out / REVERSE_DIR
    return sorted(p for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def load_ours_outputs(case_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(case_dir / OURS_OUTPUTS))


def write_reverse_result(out: Path, results: dict[str, Any]) -> None:
    """``out/reverse/result.json``: ``{"peer": ..., "cases": {case: {"pass": bool, ...}}, "pass": all}``."""
    doc = {"cases": results, "pass": bool(results) and all(r.get("pass") for r in results.values())}
    (out / REVERSE_DIR / REVERSE_RESULT).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def fresh_output_dir(out: Path) -> None:
    """Create ``out`` and remove the peer's case folders in it, keeping what our env wrote (``reverse/``)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.is_dir() and p.name != REVERSE_DIR:
            shutil.rmtree(p)


def run_reverse(out: Path, load_and_run: Callable[[Path, torch.Tensor], tuple[dict[str, torch.Tensor], dict]],
                tol: float = 1e-5) -> None:
    """The reverse check of a sparse coder: for each case our ``save`` wrote under ``out/reverse``, the
    peer loads it and runs it on our inputs (``load_and_run(case_dir, x) -> (outputs, extra record)``,
    outputs with ``feature_acts``, ``sae_out``, ``l0``); encode and forward must agree within ``tol``
    relative and L0 exactly. A failure is recorded in ``result.json`` (the test reads it), not hidden."""
    cases = reverse_cases(out)
    if not cases:
        return
    results: dict[str, Any] = {}
    for case in cases:
        ours = load_ours_outputs(case)
        try:
            got, extra = load_and_run(case, ours["x"])
            r = {**extra, "encode_max_rel": max_rel(got["feature_acts"], ours["feature_acts"]),
                 "forward_max_rel": max_rel(got["sae_out"], ours["sae_out"]),
                 "same_l0": bool(torch.equal(got["l0"], ours["l0"]))}
            r["pass"] = r["encode_max_rel"] <= tol and r["forward_max_rel"] <= tol and r["same_l0"]
        except Exception as e:  # recorded, not hidden: the test reads result.json
            r = {"pass": False, "error": f"{type(e).__name__}: {e}"}
        results[case.name] = r
    write_reverse_result(out, results)
    print(json.dumps(results, indent=1))
