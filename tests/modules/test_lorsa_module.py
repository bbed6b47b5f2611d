"""The torch-only Lorsa module against an explicit per-head reference (paper §3, Algorithm 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.errors import CheckpointError, ShapeError
from nnsight_lorsa.modules import RotaryConfig

ROPE = RotaryConfig(head_dim=8, rotary_dim=8, base=10000.0, rope_type="llama3",
                    scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16})


def make(qk_norm: bool = False, rotary: RotaryConfig | None = ROPE, seed: int = 0) -> Lorsa:
    torch.manual_seed(seed)
    cfg = LorsaConfig(d_model=24, n_qk_heads=3, d_qk_head=8, n_ov_heads=48, top_k=5, rotary=rotary, qk_norm=qk_norm)
    lorsa = Lorsa(cfg)
    with torch.no_grad():
        for p in lorsa.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return lorsa


def reference(lorsa: Lorsa, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 of the paper: every OV head computed on its own, with an explicit softmax."""
    cfg = lorsa.cfg
    b, s, _ = x.shape
    q_all, k_all = lorsa.qk(x)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    z_pre = torch.zeros(b, s, cfg.n_ov_heads)
    for h in range(cfg.n_ov_heads):
        g = h // cfg.group_size
        scores = q_all[:, g] @ k_all[:, g].transpose(-1, -2) / cfg.scale
        pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        v = x @ lorsa.W_V[h] + lorsa.b_V[h]
        z_pre[:, :, h] = (pattern @ v[..., None])[..., 0]
    acts = z_pre.relu()
    keep = torch.zeros_like(acts, dtype=torch.bool).scatter(-1, z_pre.topk(cfg.top_k, -1).indices, True)
    z = acts * keep
    return z_pre, z @ lorsa.W_O + lorsa.b_D


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rotary", [ROPE, None], ids=["rope", "no-rope"])
@torch.no_grad()
def test_forward_matches_per_head_reference(qk_norm, rotary):
    lorsa = make(qk_norm, rotary)
    x = torch.randn(2, 11, 24)
    out, cache = lorsa(x, return_cache=True)
    z_pre, want = reference(lorsa, x)
    assert (cache.z_pre - z_pre).abs().max() < 1e-5
    assert (out - want).abs().max() < 1e-5
    assert ((cache.z > 0).sum(-1) <= 5).all()
    assert torch.equal(cache.active, cache.z > 0)


@pytest.mark.parametrize("qk_norm", [False, True])
@torch.no_grad()
def test_forward_matches_a_plain_reference_off_the_defaults(qk_norm):
    """Mutation probe (2026-11-28): a set ``attn_scale`` (not ``sqrt(d_qk_head)``) divides the scores, and a head
    among the top k whose ``z_pre`` is negative is ReLU'd to 0 (``b_V`` shifted down so that most ``z_pre`` are
    negative: a top-k that forgot the ReLU, an SDPA left at its default scale, or a QK-norm over the wrong dim passed
    the reference above, which takes q and k from the module).
    Plain torch, no call into the module but its parameters."""
    torch.manual_seed(1)
    cfg = LorsaConfig(d_model=24, n_qk_heads=3, d_qk_head=8, n_ov_heads=12, top_k=5, attn_scale=2.5,
                      qk_norm=qk_norm)
    lorsa = Lorsa(cfg)
    for p in lorsa.parameters():
        p.add_(0.3 * torch.randn_like(p))
    lorsa.b_V.sub_(1.0)
    x = torch.randn(2, 7, 24)
    out, cache = lorsa(x, return_cache=True)
    q = torch.einsum("bsd,hde->bhse", x, lorsa.W_Q) + lorsa.b_Q[None, :, None]
    k = torch.einsum("bsd,hde->bhse", x, lorsa.W_K) + lorsa.b_K[None, :, None]
    if qk_norm:  # RMSNorm over each head's d_qk, a weight per head
        eps = cfg.qk_norm_eps
        q = q * (q.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * lorsa.ln_q.w[:, None]
        k = k * (k.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * lorsa.ln_k.w[:, None]
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    pattern = (q @ k.transpose(-1, -2) / 2.5).masked_fill(~causal, float("-inf")).softmax(-1)  # (b, n_qk, s, s)
    v = x @ lorsa.W_V.T + lorsa.b_V  # (b, s, n_ov)
    g = cfg.group_size
    z_pre = torch.stack([(pattern[:, h // g] @ v[..., h, None])[..., 0] for h in range(cfg.n_ov_heads)], -1)
    top = z_pre.topk(5, -1)
    z = torch.zeros_like(z_pre).scatter(-1, top.indices, top.values.clamp_min(0))
    assert bool((top.values < 0).any()), "the draw must put a negative z_pre among the top k"
    want = z @ lorsa.W_O + lorsa.b_D
    assert (cache.z_pre - z_pre).abs().max() <= 1e-5 * z_pre.abs().max()
    assert (cache.z - z).abs().max() <= 1e-5 * z.abs().max()
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("rotary", [ROPE, None], ids=["rope", "no-rope"])
def test_qk_both_projection_paths_match_a_per_head_reference(rotary, batch, dtype):
    """``qk`` projects by a per-head batched matmul without autograd on x and by one fused matmul when x needs
    a gradient: both equal each head's own ``x W_Q[h] + b_Q[h]`` (then RoPE by transformers' rotate_half)."""
    lorsa = make(rotary=rotary).to(dtype)
    x = torch.randn(batch, 9, 24, dtype=dtype)
    cfg = lorsa.cfg
    q_ref = torch.stack([x @ lorsa.W_Q[h] + lorsa.b_Q[h] for h in range(cfg.n_qk_heads)], 1).detach()
    k_ref = torch.stack([x @ lorsa.W_K[h] + lorsa.b_K[h] for h in range(cfg.n_qk_heads)], 1).detach()
    if rotary is not None:
        from nnsight_lorsa.modules.rotary import rotary_cos_sin
        cos, sin = (t.to(dtype) for t in rotary_cos_sin(rotary, torch.arange(9)))
        half = cfg.d_qk_head // 2
        rot = lambda t: torch.cat([-t[..., half:], t[..., :half]], -1)  # noqa: E731  (transformers' rotate_half)
        q_ref, k_ref = q_ref * cos + rot(q_ref) * sin, k_ref * cos + rot(k_ref) * sin
    with torch.no_grad():
        q_free, k_free = lorsa.qk(x)
    q_grad, k_grad = lorsa.qk(x.clone().requires_grad_(True))
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in [(q_free, q_ref), (k_free, k_ref), (q_grad, q_ref), (k_grad, k_ref)]:
        assert got.shape == (batch, cfg.n_qk_heads, 9, cfg.d_qk_head)
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < bound
    assert q_grad.requires_grad and not q_free.requires_grad


@torch.no_grad()
def test_z_pattern_sums_to_z_and_patterns_are_causal():
    lorsa = make()
    x = torch.randn(1, 9, 24)
    _, cache = lorsa(x, return_cache=True)
    heads = [0, 17, 47]
    zp = lorsa.z_pattern(x, heads)
    assert zp.shape == (1, 3, 9, 9)
    assert (zp.sum(-1) - cache.z_pre[..., heads].transpose(1, 2)).abs().max() < 1e-5
    active = cache.z[..., heads].transpose(1, 2) > 0
    assert (zp.sum(-1)[active] - cache.z[..., heads].transpose(1, 2)[active]).abs().max() < 1e-5
    pattern = lorsa.attention_pattern(x, qk_heads=[1])
    assert torch.allclose(pattern.sum(-1), torch.ones(1, 1, 9))
    assert (pattern.triu(1) == 0).all()
    with pytest.raises(ShapeError, match="ov_heads"):
        lorsa.z_pattern(x, [48])


@torch.no_grad()
def test_unit_decoder_reparametrisation():
    lorsa = make()
    lorsa.normalize_decoder_()
    x = torch.randn(2, 6, 24)
    before = lorsa(x)
    lorsa.W_O.mul_(3.0)  # the same function with ‖w_o‖ = 3: normalising moves the norm back into w_v, b_v
    lorsa.W_V.div_(3.0)
    lorsa.b_V.div_(3.0)
    lorsa.normalize_decoder_()
    assert torch.allclose(lorsa.W_O.norm(dim=1), torch.ones(48), atol=1e-6)
    assert (lorsa(x) - before).abs().max() < 1e-5
    # per-head norms: afterwards heads are ranked by their output norm z·‖w_o‖
    scale = torch.rand(48) + 0.5
    lorsa.W_O.mul_(scale[:, None])
    z_pre = lorsa.compute_z_pre(x)
    keep = torch.zeros_like(z_pre, dtype=torch.bool).scatter(-1, (z_pre * scale).topk(5, -1).indices, True)
    want = (z_pre.relu() * keep) @ lorsa.W_O + lorsa.b_D
    lorsa.normalize_decoder_()
    assert (lorsa(x) - want).abs().max() < 1e-5


@torch.no_grad()
def test_key_padding_mask_isolates_left_padding():
    lorsa = make()
    x = torch.randn(1, 7, 24)
    padded = torch.cat([torch.randn(1, 3, 24) * 5, x], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = lorsa(padded, positions, mask)
    assert (out[:, 3:] - lorsa(x)).abs().max() < 1e-5
    assert torch.isfinite(out).all()


def test_bad_shapes_and_configs_raise_clear_errors():
    lorsa = make()
    with pytest.raises(ShapeError, match="d_model=24"):
        lorsa(torch.randn(2, 5, 23))
    with pytest.raises((ShapeError, TypeCheckError), match="pos"):  # jaxtyping's check fires first in tests
        lorsa(torch.randn(2, 5, 24), torch.arange(4))
    with pytest.raises(CheckpointError, match="multiple of n_qk_heads"):
        LorsaConfig(d_model=8, n_qk_heads=3, d_qk_head=4, n_ov_heads=10, top_k=2)
    with pytest.raises(CheckpointError, match="top_k"):
        LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=4, top_k=5)
    with pytest.raises(CheckpointError, match="rotary.head_dim"):
        LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=4, top_k=2, rotary=ROPE)


def test_primitives_import_and_run_without_nnsight():
    code = (
        "import sys, torch\n"
        "from nnsight_lorsa import Lorsa, LorsaConfig, get_adapter, load, save\n"
        "from nnsight_lorsa.formats.lorsa_format import save_lorsa, load_lorsa\n"
        "out = Lorsa(LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=8, top_k=2))(torch.randn(1, 3, 8))\n"
        "assert out.shape == (1, 3, 8)\n"
        "assert 'nnsight' not in sys.modules, sorted(m for m in sys.modules if 'nnsight' in m)\n"
        "from nnsight_lorsa.errors import ShapeError\n"
        "try:\n    Lorsa(LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=8, top_k=2))(torch.randn(3, 8))\n"
        "except ShapeError as e:\n    assert 'd_model=8' in str(e)\nelse:\n    raise AssertionError('no ShapeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family", ["llama", "qwen3", "neox", "gpt2", "olmo2", "phi3", "gemma"])
def test_config_from_mhsa_takes_every_field_from_the_mhsa(family):
    """``LorsaConfig.from_mhsa``: the one derivation of a Lorsa's config from an MHSA (shape, RoPE, scale,
    QK norm), so that a Lorsa initialised from it reproduces the MHSA's QK scores."""
    from helpers import tiny_hf_model

    from nnsight_lorsa import get_adapter

    hf = tiny_hf_model(family)
    w = get_adapter(hf).mhsa_weights(hf, 1)
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=8 * w.n_heads, top_k=4, qk_heads_per_mhsa_head=2, layer=1,
                                architecture=family)
    assert (cfg.d_model, cfg.n_qk_heads, cfg.d_qk_head, cfg.n_ov_heads) == (w.d_model, 2 * w.n_heads, w.head_dim,
                                                                           8 * w.n_heads)
    assert cfg.rotary == w.rotary and cfg.scale == pytest.approx(1.0 / w.scale)
    assert cfg.qk_norm == (w.q_norm is not None) and cfg.qk_norm_eps == w.qk_norm_eps
    assert (cfg.layer, cfg.architecture) == (1, family)


def _transformers_rope(x, cos, sin, interleaved):
    """transformers' ``q·cos + rotate_half(q)·sin`` (GPT-J's ``rotate_every_two`` when interleaved), with
    cos/sin cast to x's dtype and the dims past ``rotary_dim`` passed through (GPT-NeoX's partial rotary)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    xr = x[..., :rot]
    if interleaved:
        turned = torch.stack((-xr[..., 1::2], xr[..., ::2]), -1).flatten(-2)
    else:
        turned = torch.cat((-xr[..., rot // 2:], xr[..., :rot // 2]), -1)
    return torch.cat((xr * cos + turned * sin, x[..., rot:]), -1)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), interleaved=st.booleans(),
       rot_quarters=st.integers(1, 4), batch=st.integers(1, 3), per_batch_positions=st.booleans(),
       seed=st.integers(0, 2**16))
def test_apply_rotary_is_bit_identical_to_transformers(dtype, interleaved, rot_quarters, batch,
                                                      per_batch_positions, seed):
    """``apply_rotary`` (pair-swap form, whole-width kernels) gives transformers' RoPE bit for bit in every
    dtype, both layouts, partial rotary, (pos,) or (batch, pos) positions, on the heads-first non-contiguous
    layout ``Lorsa.qk`` produces, with and without autograd; its gradient flows to x."""
    from nnsight_lorsa.modules.rotary import apply_rotary, rotary_cos_sin

    gen = torch.Generator().manual_seed(seed)
    heads, seq, head_dim = 3, 7, 16
    rope = RotaryConfig(head_dim=head_dim, rotary_dim=4 * rot_quarters, interleaved=interleaved)
    x = (torch.randn(heads, batch * seq, head_dim, generator=gen) * 4).to(dtype)
    x = x.view(heads, batch, seq, head_dim).transpose(0, 1)  # as Lorsa.qk's batched matmul lays it out
    positions = torch.randint(0, 100, (batch, seq), generator=gen) if per_batch_positions else torch.arange(seq)
    cos, sin = rotary_cos_sin(rope, positions)
    want = _transformers_rope(x, cos, sin, interleaved)
    with torch.no_grad():
        free = apply_rotary(x, cos, sin, interleaved)
    leaf = x.clone().requires_grad_(True)
    tracked = apply_rotary(leaf, cos, sin, interleaved)
    assert free.dtype == dtype and free.shape == x.shape
    assert torch.equal(free, want) and torch.equal(tracked.detach(), want)
    tracked.float().square().sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float64, torch.bfloat16, torch.float16]),
       with_generator=st.booleans())
def test_random_init_is_the_same_draw_in_every_dtype(seed, dtype, with_generator):
    """A Lorsa's random init (the constructor's ``reset_parameters``, and the recipe's ``ov_init="random"``
    through the same ``_normal_``) is the fp32 init in the parameters' dtype (up to the rounding of that dtype and
    of the unit-norm ``W_O`` reparametrisation computed in it), and takes as many numbers from the generator — as
    an SAE's or transcoder's (drawn in fp32, then cast). In fp64 it was another draw (0.64 off) that also advanced
    the generator differently, so every later draw of the run differed from the fp32 run's."""
    cfg = LorsaConfig(d_model=24, n_qk_heads=4, d_qk_head=8, n_ov_heads=16, top_k=4, layer=0)

    def init(dt: torch.dtype) -> tuple[Lorsa, torch.Tensor]:
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed) if with_generator else None
        lorsa = Lorsa(cfg, dtype=dt)
        if gen is not None:
            lorsa.reset_parameters(generator=gen)
        return lorsa, torch.randn(4, generator=gen)  # the next draw: the generator advanced alike

    ref, ref_next = init(torch.float32)
    got, got_next = init(dtype)
    assert torch.equal(got_next, ref_next)
    rounding = 8 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    for name, p in ref.named_parameters():
        want, have = p.detach().double(), getattr(got, name).detach().double()
        assert (have - want).abs().max() <= rounding * want.abs().max(), name
