"""The frozen pass's terms of the memory model (``estimate_memory``'s ``frozen_per_copy`` and ``frozen_shared``)
against its allocation-level peak (:func:`benchmarks._alloc_peak.allocation_peak`: reproducible to the byte) on random
Llamas whose shapes pull the structures apart and on the embedded model — one backward per target site, batches 1,
2 and 4 (to 8 on the larger models)."""

from __future__ import annotations

import pytest
import torch

import nnsight_lorsa.attribution.budget as budget
from benchmarks.attribution_memory_terms import frozen_pass_peaks, replacement_model
from nnsight_lorsa.envoy.nnsight_internals import hf_module


def prompt(rm, seq: int = 64) -> torch.Tensor:
    vocab = hf_module(rm.model).config.vocab_size
    return torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(seq))


@pytest.mark.parametrize(("shape", "dtype"), [("tiny", None), ("vocab", None), ("heads", None),
                                              ("vocab", torch.float64)])
def test_frozen_pass_peak_is_within_its_estimate(shape, dtype):
    """At every batch the frozen pass allocates at most ``frozen_per_copy · B + frozen_shared`` — on a vocabulary
    16x ``L·d``, on 16 query heads over 2 KV heads (``H·d_head`` = 4 ``d``), and computed in fp64 for an fp32 model
    (the logits in another dtype than the model's)."""
    rm, _ = replacement_model(shape)
    out = frozen_pass_peaks(rm, prompt(rm), dtype=dtype, batches=(1, 2, 4))
    for b, peak in out["peaks"].items():
        assert peak <= out["predicted"][b], (b, peak, out["predicted"][b])
    assert out["peaks"][4] > out["peaks"][1]  # the measure sees the prompt copies


def test_the_bound_needs_the_vocabulary_and_the_per_copy_structure(monkeypatch):
    """The bound is not slack: without the unembedding's logits (vocab 0) or with half the per-copy term, the same
    measured peak is above the estimate (for the per-copy term at batches 8 and 16 on the ``heads`` shape, where it
    is tightest since the frozen pass keeps no norm input: its share of the peak grows with the batch)."""
    rm, _ = replacement_model("vocab")
    ids = prompt(rm)
    info = budget.estimate_info

    monkeypatch.setattr(budget, "estimate_info", lambda *a, **k: {**info(*a, **k), "vocab": 0})
    out = frozen_pass_peaks(rm, ids, batches=(1, 2, 4))
    assert any(out["peaks"][b] > out["predicted"][b] for b in out["peaks"]), out
    monkeypatch.setattr(budget, "estimate_info", info)
    per_copy = budget.frozen_per_copy_bytes
    monkeypatch.setattr(budget, "frozen_per_copy_bytes", lambda *a, **k: per_copy(*a, **k) // 2)
    rm, _ = replacement_model("heads")
    half = frozen_pass_peaks(rm, prompt(rm), batches=(8, 16))
    assert any(half["peaks"][b] > half["predicted"][b] for b in half["peaks"]), half


@pytest.mark.parametrize(("which", "dtype"), [("tc", None), ("bundle", None), ("tc", torch.float64), ("random", None)])
def test_frozen_pass_peak_is_within_its_estimate_on_the_larger_models(which, dtype):
    """The same bound on the embedded model with its transcoders (and its Lorsa), in fp64, and on the random Llama
    of ``gpu_scale.py``'s small shape, at 128 tokens up to batch 8 (≤ 3 s each)."""
    rm, _ = replacement_model(which)
    out = frozen_pass_peaks(rm, prompt(rm, 128) % 1000, dtype=dtype)
    for b, peak in out["peaks"].items():
        assert peak <= out["predicted"][b], (b, peak, out["predicted"][b])
