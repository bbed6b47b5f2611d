"""Comparison of our loaded modules with a peer's own outputs (``tests/fixtures/peers/<peer>``).

Shared by the peer-fixture tests. Bounds: relative max error ``1e-5`` for fp32 files (same arithmetic
up to summation order), ``2e-2`` for bf16 ones (bf16 rounding of sums); the same L0 per row.
"""

from __future__ import annotations

from pathlib import Path

import torch

PEER_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "peers"


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max(max|b|, 1e-12)`` in float64."""
    return float((a.detach().double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def check_coder(module: torch.nn.Module, ref: dict[str, torch.Tensor], out_key: str = "sae_out") -> None:
    """``module.encode`` and ``module(x)`` on the peer's inputs ``ref["x"]`` match the peer's
    ``feature_acts`` / ``ref[out_key]`` within the bound for the file's dtype, and the L0 per row is equal."""
    bound = 2e-2 if ref["x"].dtype == torch.bfloat16 else 1e-5
    with torch.no_grad():
        acts = module.encode(ref["x"])  # type: ignore[operator]
        out = module(ref["x"])
    assert rel_error(acts, ref["feature_acts"]) <= bound
    assert rel_error(out, ref[out_key]) <= bound
    assert torch.equal((acts != 0).sum(-1), ref["l0"])


def case_name(fixtures: Path, case: Path) -> str:
    """A case folder's id: its path under the peer's fixture folder."""
    return case.relative_to(fixtures).as_posix()


def cases(fixtures: Path) -> list[Path]:
    """Every folder under ``fixtures`` holding a ``cfg.json`` (our ``reverse/`` copies excluded)."""
    return sorted(p.parent for p in fixtures.rglob("cfg.json") if "reverse" not in p.relative_to(fixtures).parts)


def check_case(fixtures: Path, case: Path, refused: dict[str, tuple[type[Exception], str]]) -> None:
    """A peer's case loads through our one ``load`` and matches the peer (:func:`check_coder`; the
    SAELens registry's ``norm_scaling_factor`` applied where the peer recorded one), or, when listed
    in ``refused``, raises that named error with that message."""
    import pytest
    from safetensors.torch import load_file

    from nnsight_lorsa.formats import load

    name = case_name(fixtures, case)
    if name in refused:
        error, says = refused[name]
        with pytest.raises(error, match=says):
            load(case)
        return
    ref = load_file(str(case / "reference.safetensors"))
    options = {"norm_scaling_factor": float(ref["norm_scaling_factor"])} if "norm_scaling_factor" in ref else {}
    check_coder(load(case, **options), ref)
