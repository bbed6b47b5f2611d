"""Probe: leftovers of the leftovers and primitives probes, round 2 (docs/reliability.md, "Leftovers probe, round 2").

1. A single-file write (``_atomic.atomic_file``; in ``formats/``: ``hub.write_card``) whose write fails with
   ``OSError(ENOSPC)`` part-way: our ``SaveError`` naming the file, the file there before intact (or still absent),
   no temporary left.
2. A bf16 ``BatchTopK``'s fp32 running threshold estimate through ``copy.deepcopy``, ``.to(dtype)``, ``state_dict``
   / ``load_state_dict`` and ``formats.save`` / ``load``, against a plain-torch reference of the estimate (the EMA in
   fp32 of the batch minima).
3. ``encode_sparse`` / ``decode_sparse`` under ``torch.autocast("cpu", bfloat16)``: in the dtype of the dense
   ``encode`` / ``decode`` there, and their values (relative bound).
4. An fp64 Lorsa's QK-norm and RoPE: to fp64 accuracy against an fp64 plain-torch reference; fp32 / bf16 / fp16
   results bit-equal to the former arithmetic (written out here).
"""

from __future__ import annotations

import copy
import errno
import math

import pytest
import torch
from helpers import generated, relative_norm
from hypothesis import assume
from hypothesis import strategies as st

import nnsight_lorsa._atomic as atomic
from nnsight_lorsa.errors import SaveError
from nnsight_lorsa.formats import load, save
from nnsight_lorsa.formats.hub import write_card
from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig
from nnsight_lorsa.modules.activations import BatchTopK
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16


# ------------------------------------------------------------------------------------ 1. single-file writes
class _Full:
    """A file object whose ``write`` writes half of the data, then raises ``OSError(ENOSPC)`` (a full disk)."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("before", [None, b"old contents\n"])
@pytest.mark.parametrize("writer", ["atomic_file", "write_card"])
def test_a_full_disk_in_a_single_file_write_is_our_save_error_and_leaves_the_file(tmp_path, monkeypatch, writer,
                                                                                   before):
    target = tmp_path / "README.md"
    if before is not None:
        target.write_bytes(before)
    monkeypatch.setattr(atomic, "open", lambda p, mode="r", *a, **k: _Full(open(p, mode, *a, **k)),  # noqa: SIM115
                        raising=False)
    write = (lambda: atomic.atomic_file(target, b"new contents " * 1000)) if writer == "atomic_file" else \
        (lambda: write_card(tmp_path, title="t", tags=["x"], base_model=None, body="new " * 1000))
    with pytest.raises(SaveError, match="README.md") as info:
        write()
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ([] if before is None else ["README.md"])  # no temporary
    if before is not None:
        assert target.read_bytes() == before


# ------------------------------------------------------------------------------------ 2. BatchTopK estimate
def _trained_bf16(seed: int, steps: int) -> tuple[BatchTopK, torch.Tensor]:
    """A bf16 BatchTopK after ``steps`` training batches, and the plain-torch fp32 EMA of the batch minima."""
    gen = torch.Generator().manual_seed(seed)
    act = BatchTopK(k=2, d_sae=8, threshold_lr=0.01).to(BF16).train()
    ref = None
    for _ in range(steps):
        x = (1.0 + 0.1 * torch.randn(4, 8, generator=gen)).to(BF16)
        out = act(x)
        m = out[out > 0].min().float()
        ref = m if ref is None else ref + 0.01 * (m - ref)
    return act, ref


@generated(examples=3, sweep=60, seed=st.integers(0, 2 ** 16), steps=st.integers(2, 30))
def test_a_bf16_batchtopk_estimate_through_copies_casts_and_saves(tmp_path_factory, seed, steps):
    act, ref = _trained_bf16(seed, steps)
    assert relative_norm(act._running(), ref) < 1e-6  # the estimate is the fp32 EMA (reference)
    assert torch.equal(act.threshold, act._running().to(BF16))
    exact = act._running().clone()
    assume(not torch.equal(exact, act.threshold.float()))  # the estimate off the bf16 grid
    # deep copy: the fp32 estimate bit for bit
    assert torch.equal(copy.deepcopy(act)._running(), exact)
    # .to(fp16): still low precision, the estimate carried, the buffer its fp16 rounding
    half = copy.deepcopy(act).to(F16)
    assert torch.equal(half._running(), exact) and torch.equal(half.threshold, exact.to(F16))
    # .to(fp32) / .double(): the buffer holds the estimate (was: the bf16 rounding, the estimate dropped)
    for dtype in (F32, F64):
        wide = copy.deepcopy(act).to(dtype)
        assert wide.threshold.dtype == dtype and torch.equal(wide.threshold, exact.to(dtype))
    # the state dict holds the rounded buffer only (documented): a load restarts the estimate from it
    fresh = BatchTopK(k=2, d_sae=8).to(BF16)
    fresh.load_state_dict(act.state_dict())
    assert torch.equal(fresh.threshold, act.threshold) and torch.equal(fresh._running(), act.threshold.float())


def test_a_bf16_batchtopk_sae_saved_and_loaded_keeps_its_rounded_threshold(tmp_path):
    sae = SparseAutoencoder(SAEConfig(d_in=8, d_sae=8, activation="batchtopk", activation_params={"k": 2}))
    act, _ = _trained_bf16(0, 12)
    sae = sae.to(BF16)
    sae.activation.load_state_dict(act.state_dict())
    save(sae, tmp_path / "s")
    back = load(tmp_path / "s")
    assert back.activation.threshold.dtype == BF16 and torch.equal(back.activation.threshold, act.threshold)
    assert int(back.activation.n_updates) == 12


# ------------------------------------------------------------------------------------ 3. sparse path, autocast
def _sae(seed: int, act: str) -> SparseAutoencoder:
    s = SparseAutoencoder(SAEConfig(d_in=16, d_sae=32, activation=act, activation_params={"k": 3}))
    gen = torch.Generator().manual_seed(seed)
    s.reset_parameters(gen)
    with torch.no_grad():
        s.b_enc.add_(0.1 * torch.randn(32, generator=gen))
        s.b_dec.add_(0.1 * torch.randn(16, generator=gen))
    if act == "batchtopk":
        s.activation.set_threshold(0.05)
    return s


@generated(examples=4, sweep=300, seed=st.integers(0, 2 ** 16), act=st.sampled_from(["topk", "batchtopk"]),
           train=st.booleans(), rows=st.integers(1, 6), dtype=st.sampled_from([BF16, F16]))
def test_the_sparse_path_under_autocast_is_in_the_dense_paths_dtype(seed, act, train, rows, dtype):
    s = _sae(seed, act).train(train)
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed + 1))
    dense_s = copy.deepcopy(s)
    with torch.autocast("cpu", dtype=dtype):
        dense = dense_s.encode(x)
        dense_out = dense_s.decode(dense)
        pre, acts = s.encode_sparse(x)
        out = s.decode_sparse(acts)
    assert acts.vals.dtype == dense.dtype and pre.dtype == dense.dtype
    assert out.dtype == dense_out.dtype == dtype  # was fp32 (the decoder's dtype)
    assume(torch.equal(acts.to_dense(), dense.reshape(-1, 32)))  # the same selection (rounding may flip one)
    assert relative_norm(out, dense_out) < 2e-2
    # fp32 outside autocast, unchanged
    _, acts32 = s.encode_sparse(x)
    assert s.decode_sparse(acts32).dtype == F32


# ------------------------------------------------------------------------------------ 4. fp64 QK-norm and RoPE
def _lorsa(seed: int, qk_norm: bool, rotary: str | None) -> Lorsa:
    rot = None
    if rotary is not None:
        scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8} if rotary == "llama3" else None
        rot = RotaryConfig(head_dim=8, rotary_dim=8 if rotary != "partial" else 4, base=10000.0,
                           **({"scaling": scaling, "rope_type": "llama3"} if scaling else {}))
    m = Lorsa(LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=8, n_ov_heads=8, top_k=3, rotary=rot, qk_norm=qk_norm))
    gen = torch.Generator().manual_seed(seed)
    m.reset_parameters(gen)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return m


def _ref_qk(m: Lorsa, x: torch.Tensor, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``(b, n_qk, s, e)`` in plain torch: QK-norm (RMSNorm per head) then half-split RoPE, computed in
    ``work``; cos / sin from the inverse frequencies in ``work``."""
    c = m.cfg
    p = {n: t.detach().to(work) for n, t in m.named_parameters()}
    x = x.to(work)
    q = torch.einsum("bsd,hde->bhse", x, p["W_Q"]) + p["b_Q"][None, :, None]
    k = torch.einsum("bsd,hde->bhse", x, p["W_K"]) + p["b_K"][None, :, None]
    if c.qk_norm:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + c.qk_norm_eps) * p["ln_q.w"][:, None]
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + c.qk_norm_eps) * p["ln_k.w"][:, None]
    if c.rotary is not None:
        r = c.rotary.rotary_dim
        inv = 1.0 / (c.rotary.base ** (torch.arange(0, r, 2, dtype=work) / r))
        if c.rotary.rope_type == "llama3":  # transformers' _compute_llama3_parameters, in ``work``
            sc = c.rotary.scaling
            low_w, high_w = sc["original_max_position_embeddings"] / sc["low_freq_factor"], \
                sc["original_max_position_embeddings"] / sc["high_freq_factor"]
            wl = 2 * math.pi / inv
            scaled = torch.where(wl > low_w, inv / sc["factor"], inv)
            smooth = (sc["original_max_position_embeddings"] / wl - sc["low_freq_factor"]) / \
                (sc["high_freq_factor"] - sc["low_freq_factor"])
            smoothed = (1 - smooth) * scaled / sc["factor"] + smooth * scaled
            inv = torch.where(~(wl < high_w) * ~(wl > low_w), smoothed, scaled)
        ang = torch.arange(x.shape[1], dtype=work)[:, None] * inv
        cs, sn = ang.cos(), ang.sin()

        def rot(t: torch.Tensor) -> torch.Tensor:
            a, b = t[..., : r // 2], t[..., r // 2: r]
            return torch.cat([a * cs - b * sn, b * cs + a * sn, t[..., r:]], -1)

        q, k = rot(q), rot(k)
    return q, k


@generated(examples=4, sweep=200, seed=st.integers(0, 2 ** 16), qk_norm=st.booleans(),
           rotary=st.sampled_from([None, "full", "partial", "llama3"]), s=st.integers(1, 12), grad=st.booleans())
def test_an_fp64_lorsa_rotates_and_qk_normalises_to_fp64_accuracy(seed, qk_norm, rotary, s, grad):
    assume(qk_norm or rotary is not None)
    m = _lorsa(seed, qk_norm, rotary).double()
    x = torch.randn(2, s, 16, generator=torch.Generator().manual_seed(seed + 1), dtype=F64).requires_grad_(grad)
    q, k = m.qk(x)
    rq, rk = _ref_qk(m, x.detach(), F64)
    assert q.dtype == F64
    # was ~1e-8 (cos / sin and the RMSNorm in fp32)
    assert relative_norm(q, rq) < 1e-12 and relative_norm(k, rk) < 1e-12


def _former_qk(m: Lorsa, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Lorsa.qk``'s arithmetic before the fp64 change (2026-11-28), for fp32 / bf16 / fp16: the RMSNorm in fp32,
    cos / sin in fp32 (the module's own functions, which are unchanged at fp32)."""
    from nnsight_lorsa.modules.rotary import apply_rotary, rotary_cos_sin

    b, s, d = x.shape
    h, e = m.cfg.n_qk_heads, m.cfg.d_qk_head
    xs = x.reshape(b * s, d).expand(h, b * s, d)
    q = torch.baddbmm(m.b_Q[:, None, :], xs, m.W_Q).view(h, b, s, e).transpose(0, 1)
    k = torch.baddbmm(m.b_K[:, None, :], xs, m.W_K).view(h, b, s, e).transpose(0, 1)
    if m.cfg.qk_norm:
        def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            v = t.to(F32)
            return w[:, None, :] * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + m.cfg.qk_norm_eps)).to(t.dtype)
        q, k = norm(q, m.ln_q.w), norm(k, m.ln_k.w)
    if m.cfg.rotary is not None:
        cos, sin = rotary_cos_sin(m.cfg.rotary, torch.arange(s))
        assert cos.dtype == F32
        q, k = apply_rotary(q, cos, sin, False), apply_rotary(k, cos, sin, False)
    return q, k


@generated(examples=4, sweep=200, seed=st.integers(0, 2 ** 16), qk_norm=st.booleans(),
           rotary=st.sampled_from([None, "full", "partial", "llama3"]), s=st.integers(1, 12),
           dtype=st.sampled_from([F32, BF16, F16]))
def test_lower_precision_lorsas_rotate_and_normalise_bit_for_bit_as_before(seed, qk_norm, rotary, s, dtype):
    m = _lorsa(seed, qk_norm, rotary).to(dtype)
    x = torch.randn(2, s, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    with torch.no_grad():
        q, k = m.qk(x)
        fq, fk = _former_qk(m, x)
    assert torch.equal(q, fq) and torch.equal(k, fk)
