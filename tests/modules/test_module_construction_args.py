"""A replacement module's constructor checks ``device`` / ``dtype`` as every loader does, before any tensor is made:
an integer or complex dtype was torch's "Only Tensors of floating point ... can require gradients", a device string
that names none a ``RuntimeError`` listing torch's backends, a CUDA device on a machine without one an
``AssertionError`` ("Torch not compiled with CUDA enabled") — from the first ``torch.empty`` (probe of 2026-11-29,
fourth session). Wrong kinds (a dict for ``cfg``, ``"bf16"``, ``float``) run outside the suite's beartype hook in
``tests/wrong_kind_cases.py``."""

from __future__ import annotations

import pytest
import torch

from nnsight_lorsa.errors import ArgumentError, PlacementError
from nnsight_lorsa.modules import (
    CLTConfig,
    CrossLayerTranscoder,
    Lorsa,
    LorsaConfig,
    SAEConfig,
    SparseAutoencoder,
    Transcoder,
    TranscoderConfig,
)

KINDS = {
    "Lorsa": lambda **kw: Lorsa(LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=4, top_k=2), **kw),
    "SparseAutoencoder": lambda **kw: SparseAutoencoder(SAEConfig(d_in=8, d_sae=16, activation="relu"), **kw),
    "Transcoder": lambda **kw: Transcoder(TranscoderConfig(d_in=8, d_out=8, d_sae=16, activation="relu"), **kw),
    "CrossLayerTranscoder": lambda **kw: CrossLayerTranscoder(CLTConfig(n_layers=2, d_in=8, d_sae=16,
                                                                        activation="relu"), **kw),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_a_dtype_that_is_no_floating_one_is_refused_by_name(kind, dtype):
    with pytest.raises(ArgumentError, match=rf"^{kind}: dtype must be None or a floating torch.dtype"):
        KINDS[kind](dtype=dtype)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_device_that_is_none_or_absent_is_refused_by_name(kind):
    with pytest.raises(ArgumentError, match=rf"^{kind}: device 'nope' is not a device"):
        KINDS[kind](device="nope")
    if not torch.cuda.is_available():
        with pytest.raises(PlacementError, match=rf"^{kind}: torch cannot put tensors on cuda:0 here"):
            KINDS[kind](device="cuda:0")


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_floating_dtype_and_the_meta_device_are_built_as_asked(kind, dtype):
    module = KINDS[kind](device="meta", dtype=dtype)
    assert {(p.device.type, p.dtype) for p in module.parameters()} == {("meta", dtype)}
