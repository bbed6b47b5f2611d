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


def gemma(family: str, attn: str = "eager"):
    """The tiny Gemma-2 / Gemma-3 of the attribution tests (``tests/helpers.py``: layers 0 and 2 sliding with a window
    of 4, Gemma-2's soft-capped, a Lorsa on layer 1, transcoders on layers 0 and 2) as a replacement model."""
    from nnsight_lorsa import ReplacementModel, get_adapter
    from tests.helpers import make_lorsa, make_transcoders, tiny_nnsight

    model, hf = tiny_nnsight(family, attn=attn)
    return ReplacementModel(model, lorsas={1: make_lorsa(hf, get_adapter(model), 1)},
                            transcoders=make_transcoders((0, 2), skip_layer=2))


@pytest.mark.parametrize(("family", "attn", "patterns"), [("gemma2", "eager", "auto"), ("gemma2", "eager", "sdpa"),
                                                           ("gemma3", "eager", "auto"), ("gemma3", "sdpa", "sdpa")])
def test_frozen_pass_peak_is_within_its_estimate_on_gemma(family, attn, patterns):
    """Gemma-2 / Gemma-3 at 512 tokens, batches 1-8: the frozen pass allocates at most its estimate — with their
    post-attention and post-feedforward norms (``4L + 1`` frozen norms), Gemma-2's soft-capped MHSA patterns kept
    also where the others' go through SDPA (``patterns="sdpa"``, the GPU's path), and the model's own attention
    masks, one per prompt copy for the full and one for the sliding layers (eager: in the model's dtype; SDPA:
    the sliding one, bool) — and not far above it (at least 0.8 of it)."""
    rm = gemma(family, attn)
    out = frozen_pass_peaks(rm, prompt(rm, 512), patterns=patterns, batches=(1, 4, 8))
    for b, peak in out["peaks"].items():
        assert 0.8 * out["predicted"][b] <= peak <= out["predicted"][b], (b, peak, out["predicted"][b])
