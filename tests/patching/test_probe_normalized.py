"""The normalized patching effect where clean and corrupt metrics are equal or within rounding (docs/reliability.md,
"Demo outputs, normalized effect and SentencePiece IOI probe (2026-11-27)").

``PatchingResult.normalized = (patched − corrupt) / (clean − corrupt)`` and ``PathPatchingResult.normalized =
(clean − patched) / (clean − corrupt)`` divide by the clean–corrupt gap. Where it is 0 the division gave ±inf / NaN,
and where it is a few ulps it gave finite numbers of 10⁶ and more made of rounding noise. Now such rows raise
``UndefinedNormalizationError`` naming the rows and the two metrics; elsewhere the result equals the formula
evaluated in float64 (relative bound). Generated: clean metrics over many magnitudes, corrupt ones 0–6 units of the
logits' rounding away (fp32 / bf16 / fp16 logits) or far away; the two result classes; and through
``activation_patching`` / ``path_patching`` on the tiny Llama with the clean prompts as their own corrupt prompts.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import generated, tiny_nnsight
from hypothesis import strategies as st

from nnsight_lorsa.errors import UndefinedNormalizationError
from nnsight_lorsa.patching import MHSAHead
from nnsight_lorsa.patching.experiments import PatchingResult
from nnsight_lorsa.patching.path_patching import PathPatchingResult

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the gap below which the rows are refused, in units of the logits' eps times the larger |metric|
TOLERANCE = 4


def _results(clean, corrupt, patched, dtype):
    groups = [(MHSAHead(0, i),) for i in range(patched.shape[0])]
    eps = torch.finfo(dtype).eps
    return (PatchingResult(groups, clean, corrupt, patched, rounding=eps),
            PathPatchingResult(groups, [], clean, corrupt, patched, rounding=eps))


@generated(80, 2000, seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
           scale=st.sampled_from([0.0, 1e-30, 1e-6, 1e-2, 1.0, 3.0, 1e3, 1e6]),
           nudge=st.lists(st.integers(-6, 6), min_size=1, max_size=4), far=st.booleans())
def test_normalized_is_the_formula_or_a_named_refusal_of_the_rows_within_rounding(seed, dtype, scale, nudge, far):
    g = torch.Generator().manual_seed(seed)
    b = len(nudge)
    clean = (torch.randn(b, generator=g) * scale).to(dtype).float()  # metrics from logits in `dtype`
    clean = torch.where(torch.isfinite(clean), clean, torch.finfo(dtype).max)  # (make_metric refuses inf metrics)
    eps = torch.finfo(dtype).eps
    gap = clean.abs().clamp_min(1.0 if far else 0.0) * eps * torch.tensor(nudge, dtype=torch.float32)
    corrupt = clean - (gap * (1e4 if far else 1.0))
    patched = torch.randn(3, b, generator=g) * max(scale, 1e-3)
    c64, k64, p64 = clean.double(), corrupt.double(), patched.double()
    diff = (c64 - k64).abs()
    degenerate = diff <= TOLERANCE * eps * torch.maximum(c64.abs(), k64.abs())
    for res, num in zip(_results(clean, corrupt, patched, dtype), (p64 - k64, c64 - p64), strict=True):
        if bool(degenerate.any()):
            rows = degenerate.nonzero().flatten().tolist()
            with pytest.raises(UndefinedNormalizationError, match=r"rows \[" + ", ".join(map(str, rows)) + r"\]"):
                res.normalized  # noqa: B018
            if isinstance(res, PatchingResult):  # its top ranks the normalized effect (PathPatchingResult's the effect)
                with pytest.raises(UndefinedNormalizationError):
                    res.top(1)
            continue
        got = res.normalized.double()
        want = num / (c64 - k64)[None]
        assert bool(torch.isfinite(got).all()), got
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)


def test_equal_clean_and_corrupt_rows_were_nan_or_inf_and_are_now_named():
    """Seen failing: ``normalized`` returned NaN for ``patched == corrupt == clean`` and ±inf elsewhere in the row,
    and 8388608 for a one-ulp gap (fp32), with no word."""
    clean = torch.tensor([2.0, 1.0, 0.0])
    corrupt = torch.tensor([-1.0, 1.0 + 2**-23, 0.0])
    patched = torch.tensor([[0.5, 2.0, 0.0], [1.0, 1.0, 1.0]])
    groups = [(MHSAHead(0, 0),), (MHSAHead(0, 1),)]
    for res in (PatchingResult(groups, clean, corrupt, patched), PathPatchingResult(groups, [], clean, corrupt,
                                                                                    patched)):
        with pytest.raises(UndefinedNormalizationError, match=r"rows \[1, 2\]") as info:
            res.normalized  # noqa: B018
        assert isinstance(info.value, ZeroDivisionError) and "clean" in str(info.value)
    ok = PatchingResult(groups, clean[:1], corrupt[:1], patched[:, :1])
    assert torch.equal(ok.normalized, (patched[:, :1] - corrupt[:1]) / (clean[:1] - corrupt[:1]))


@pytest.fixture(scope="module")
def llama():
    from nnsight_lorsa.envoy.replacement_model import ReplacementModel

    model, _ = tiny_nnsight("llama", dtype=torch.bfloat16)
    return ReplacementModel(model)


def test_experiments_with_equal_clean_and_corrupt_prompts_refuse_normalized(llama):
    """Seen failing: ``activation_patching`` / ``path_patching`` with the clean prompts as the corrupt ones (bf16
    model) returned a NaN ``normalized`` — every row 0/0."""
    from nnsight_lorsa.patching import activation_patching
    from nnsight_lorsa.patching.path_patching import path_patching

    ids = torch.randint(2, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(correct_ids=[3, 4], incorrect_ids=[5, 6])
    for res in (activation_patching(llama, ids, ids.clone(), [MHSAHead(0, 0)], **kw),
                path_patching(llama, ids, [MHSAHead(0, 0)], corrupt=ids.clone(), **kw)):
        with pytest.raises(UndefinedNormalizationError, match=r"rows \[0, 1\]"):
            res.normalized  # noqa: B018
        assert res.rounding == torch.finfo(torch.bfloat16).eps  # the logits' dtype
    assert not math.isnan(float(res.effect.sum()))  # the effect itself stays defined
