"""The sparse TopK / BatchTopK fast path equals the dense reference in values and gradients (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.modules.activations import BatchTopK, TopK
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.sparse_decode import (
    SparseActs,
    batch_topk_indices,
    gathered_preact,
    sparse_decode,
    topk_indices,
)
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TrainConfig, Trainer

N, D, F, K = 40, 16, 96, 6


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(1.0, float(a.detach().abs().max()))
    assert (a - b).abs().max() <= 2e-6 * scale, (what, float((a - b).abs().max()))


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, requires_grad=True)
    W = (torch.randn(D, F, generator=g) / 4).requires_grad_(True)
    b = (0.3 * torch.randn(F, generator=g)).requires_grad_(True)
    W_dec = torch.randn(F, D, generator=g).requires_grad_(True)
    b_dec = torch.randn(D, generator=g).requires_grad_(True)
    return x, W, b, W_dec, b_dec, torch.randn(N, D, generator=g)


@pytest.mark.parametrize("rule", ["topk", "batchtopk"])
def test_kernels_equal_dense_reference_values_and_gradients(rule):
    x, W, b, W_dec, b_dec, grad_out = _inputs()
    leaves = (x, W, b, W_dec, b_dec)
    pre = torch.addmm(b, x, W)
    dense_acts = TopK(K)(pre) if rule == "topk" else BatchTopK(K, F).batch_topk(pre)
    ref_out = dense_acts @ W_dec + b_dec
    ref_grads = torch.autograd.grad(ref_out, leaves, grad_out)

    with torch.no_grad():
        pre0 = torch.addmm(b, x, W)
    rows, cols, offsets = topk_indices(pre0, K) if rule == "topk" else batch_topk_indices(pre0, K)
    vals = gathered_preact(x, W, b, rows, cols, offsets, pre0).relu()
    acts = SparseActs(rows=rows, cols=cols, vals=vals, offsets=offsets, d_sae=F)
    assert torch.equal(acts.to_dense(), dense_acts)
    out = sparse_decode(acts, W_dec, b_dec)
    _close(ref_out, out, "out")
    grads = torch.autograd.grad(out, leaves, grad_out)
    for name, a, g in zip(("x", "W_enc", "b_enc", "W_dec", "b_dec"), ref_grads, grads, strict=True):
        _close(a, g, name)
    # the backward is sparse: features never selected get exactly zero encoder/decoder gradient
    unused = torch.ones(F, dtype=torch.bool)
    unused[cols] = False
    assert unused.any() and grads[1][:, unused].abs().max() == 0 and grads[3][unused].abs().max() == 0
    if rule == "batchtopk":  # rows hold different numbers of features, some none
        sizes = torch.bincount(rows, minlength=N)
        assert sizes.min() < sizes.max()


def test_batchtopk_rows_can_be_empty():
    pre = torch.full((4, 10), -1.0)
    pre[2, 3] = 5.0
    rows, cols, offsets = batch_topk_indices(pre, 1)
    vals = pre[rows, cols].relu()
    W_dec = torch.randn(10, 3)
    out = sparse_decode(SparseActs(rows=rows, cols=cols, vals=vals, offsets=offsets, d_sae=10), W_dec)
    assert torch.allclose(out, BatchTopK(1, 10).batch_topk(pre) @ W_dec)


def _coders():
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=D, d_sae=F, activation="topk", activation_params={"k": K}))
    tc = SkipTranscoder(TranscoderConfig(d_in=D, d_sae=F, activation="batchtopk", activation_params={"k": K}))
    with torch.no_grad():
        for m in (sae, tc):
            m.b_enc.normal_(0, 0.3)
            m.b_dec.normal_(0, 0.3)
        tc.W_skip.normal_(0, 0.1)
    return sae, tc


@pytest.mark.parametrize("which", ["sae_topk", "skip_batchtopk"])
def test_encode_sparse_matches_encode_and_forward_gradients(which):
    sae, tc = _coders()
    coder = sae if which == "sae_topk" else tc
    x = torch.randn(2, N // 2, D)
    grad_out = torch.randn(N, D)
    ref = coder(x).reshape(N, D)
    ref_grads = torch.autograd.grad(ref, list(coder.parameters()), grad_out)
    theta_dense = coder.activation.threshold.clone() if which != "sae_topk" else None
    pre, acts = coder.encode_sparse(x)
    if theta_dense is not None:  # the batch rule updated the threshold a second time, with the same value
        assert int(coder.activation.n_updates) == 2 and torch.equal(coder.activation.threshold, theta_dense)
    assert torch.equal(acts.to_dense(), coder.encode(x).reshape(N, F))
    assert not pre.requires_grad
    out = coder.decode_sparse(acts)
    skip = coder.skip(x.reshape(N, D))
    out = out if skip is None else out + skip
    _close(ref, out, "out")
    grads = torch.autograd.grad(out, list(coder.parameters()), grad_out)
    for (name, _), a, g in zip(coder.named_parameters(), ref_grads, grads, strict=True):
        _close(a, g, name)  # for the SAE: b_dec also through the input centring


def test_encode_sparse_eval_threshold_and_errors():
    _, tc = _coders()
    tc.activation.set_threshold(0.2)
    tc.eval()
    x = torch.randn(N, D)
    _, acts = tc.encode_sparse(x)
    assert torch.equal(acts.to_dense(), tc.encode(x))
    assert torch.allclose(tc.decode_sparse(acts), tc.decode(tc.encode(x)), atol=1e-5)
    relu = Transcoder(TranscoderConfig(d_in=D, d_sae=F))
    assert not relu.supports_sparse and tc.supports_sparse
    with pytest.raises(CheckpointError, match="no sparse fast path"):
        relu.encode_sparse(x)


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


@pytest.mark.parametrize("kind", ["topk_transcoder", "batchtopk_sae"])
def test_training_with_sparse_kernels_equals_dense_training(setup, kind):
    model, hf, adapter, data = setup
    if kind == "topk_transcoder":
        source = ActivationSource.transcoder(model, 1, data, batch_size=8)
    else:
        source = ActivationSource.sae(model, Site.mlp_input(adapter, 1), data, batch_size=8)
    batches = {i: source(i) for i in range(12)}

    def make(sparse: bool) -> Trainer:
        torch.manual_seed(0)
        d = adapter.d_model
        if kind == "topk_transcoder":
            coder = Transcoder(TranscoderConfig(d_in=d, d_sae=256, activation="topk", activation_params={"k": 8}))
        else:
            coder = SparseAutoencoder(SAEConfig(d_in=d, d_sae=256, activation="batchtopk",
                                                activation_params={"k": 8}))
        # dead_after_tokens small: AuxK is active from step 2 on
        cfg = TrainConfig(total_steps=8, lr=1e-2, dead_after_tokens=100, log_every=1, sparse_kernels=sparse)
        return Trainer(coder, batches.__getitem__, cfg)

    dense, fast = make(False), make(True)
    dense.train(progress=False)
    fast.train(progress=False)
    assert any(h["aux"] > 0 for h in fast.history)
    for h_d, h_f in zip(dense.history, fast.history, strict=True):
        for key in ("loss", "fvu", "l0", "dead_frac", "aux"):
            assert h_f[key] == pytest.approx(h_d[key], rel=1e-4, abs=1e-6), key
    for (name, a), b in zip(dense.module.state_dict().items(), fast.module.state_dict().values(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), name
    assert torch.equal(dense.tokens_since_fired, fast.tokens_since_fired)
