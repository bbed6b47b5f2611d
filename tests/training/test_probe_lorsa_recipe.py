"""Lorsa recipe probe: ``k_schedule``, ``init_lorsa``, ``ghost_loss``, ``revive_dead``, ``resample_dead`` and
``HeadBalance`` against plain-torch references written here from the formulas the recipe documents
(``nnsight_lorsa/training/lorsa_recipe.py``'s docstrings, docs/training.md; the Lorsa paper's App. B.3 for the QK
copy), none of the recipe's own helpers used.

Inputs are drawn with hypothesis: sizes (``d_model``, MHSA heads, GQA KV heads, head size, QK heads per MHSA head,
OV heads per QK head), RoPE or none, per-head QK-norm or none, ``top_k``, windows with a BOS column and ragged right
padding whose padded positions hold garbage (so that using one shows), ``y`` the MHSA's own output plus noise, dead
masks (none, one, all, random). The references:

* k annealing: ``k_anneal_from`` at step 0, linearly down to ``top_k`` at ``k_anneal_frac · total_steps``, each k
  rounded up, ``top_k`` from there on; in exact rational arithmetic, ``k_anneal_frac`` the decimal it is written as.
* init: QK head ``h`` is MHSA head ``h // rep``'s query and KV head ``(h // rep) // (n_heads / n_kv)``'s key (with
  biases and QK-norm gains), acting on ``x · s_in``: its pattern equals the MHSA head's (RoPE and QK-norm written
  out here). OV (``value_svd``): ``w_v`` = ``c`` times the top ``d_head`` principal directions (demeaned, counted
  tokens only, each signed with its largest-magnitude entry positive) of the head's values ``x W_V W_Vᵀ``,
  ``w_o = w_v W_V W_O``, both unit rows; ``output_svd`` the converse from the head's outputs; ``mhsa``: ``w_v = W_V
  u``, ``w_o ∝ u W_O``; ``c, u`` the generator's draws in the documented order. Then the closed-form MSE-optimal
  scale ``c* = ⟨D − D̄, t − t̄⟩ / ‖D − D̄‖²`` (1 if not positive) into ``‖w_o‖`` or ``w_v, b_v``, ``b_D = t̄ − c* D̄``,
  and the returned FVU.
* ghost grads (Jermyn & Templeton 2024): ``exp(z_pre)`` of the dead heads decoded, rescaled (detached factor) to
  half the error's norm per token, ``mean ‖ghost − e‖² / mean ‖e‖²``; value and gradients.
* revive / resample / balance: the rules of their docstrings, step by step.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.adapters.base import MHSAWeights
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.modules.rotary import RotaryConfig
from nnsight_lorsa.training import LorsaObjective
from nnsight_lorsa.training.lorsa_recipe import (
    HeadBalance,
    LorsaRecipe,
    ghost_loss,
    init_lorsa,
    k_schedule,
    resample_dead,
    revive_dead,
)

D64 = torch.float64


def drawn(body, n: int, n_sweep: int, **strategies):
    """``body`` as a hypothesis test of ``n`` examples (the default run) and a ``slow`` sweep of ``n_sweep``."""
    fast = settings(max_examples=n, deadline=None)(given(**strategies)(body))
    sweep = settings(max_examples=n_sweep, deadline=None)(given(**strategies)(body))
    return fast, pytest.mark.slow(sweep)


# ------------------------------------------------------------------------------------------- k annealing
def ref_k(step: int, total: int, top_k: int, k0: int | None, frac: float) -> int:
    if k0 is None or k0 <= top_k:
        return top_k
    span = Fraction(repr(frac)) * total                  # the decimal as written, times the steps: exact
    if span <= 0 or step >= span:
        return top_k
    return max(top_k, math.ceil(k0 + (top_k - k0) * Fraction(step) / span))


FRACS = st.one_of(st.integers(0, 100).map(lambda n: n / 100), st.sampled_from([0.05, 0.15, 0.25, 1 / 3, 0.7, 1.0]))


def _k_schedule_anneals_linearly(total, top_k, extra, frac):
    k0 = None if extra is None else max(1, top_k + extra)          # top_k: no annealing; below it: refused
    recipe = LorsaRecipe(k_anneal_from=k0, k_anneal_frac=frac)
    if k0 is not None and k0 < top_k:
        with pytest.raises(ConfigMismatchError, match="k_anneal_from"):
            k_schedule(0, total, top_k, recipe)
        return
    ks = [k_schedule(s, total, top_k, recipe) for s in range(total + 2)]
    want = [ref_k(s, total, top_k, k0, frac) for s in range(total + 2)]
    assert ks == want, [(s, a, b) for s, (a, b) in enumerate(zip(ks, want, strict=True)) if a != b][:5]
    hi = top_k if k0 is None else max(k0, top_k)
    assert all(top_k <= k <= hi for k in ks) and all(a >= b for a, b in zip(ks, ks[1:], strict=False))
    span = Fraction(repr(frac)) * total
    if k0 is not None and k0 > top_k and span > 0:
        assert ks[0] == k0
    assert ks[math.ceil(span):] == [top_k] * (len(ks) - math.ceil(span))


test_k_schedule_anneals_linearly, test_k_schedule_anneals_linearly_sweep = drawn(
    _k_schedule_anneals_linearly, 300, 3000, total=st.integers(1, 400), top_k=st.integers(1, 64),
    extra=st.one_of(st.none(), st.integers(-3, 200)), frac=FRACS)


def test_k_schedule_reaches_top_k_at_the_documented_step_without_float_noise():
    # 64 − 48 · 1/1.2 = 24 and 28 − 27 · 17/18.36 = 3 exactly; in floats 24.000000000000007 and 3.0000000000000036,
    # rounded up to 25 and 4 (failed before the fix)
    assert k_schedule(1, 6, 16, LorsaRecipe(k_anneal_from=64, k_anneal_frac=0.2)) == 24
    assert k_schedule(17, 54, 1, LorsaRecipe(k_anneal_from=28, k_anneal_frac=0.34)) == 3


def test_k_anneal_from_below_top_k_is_refused_naming_it():
    """``k_anneal_from < top_k`` (annealing *up*?) meant no annealing, without a word (failed before the fix): now
    ``ConfigMismatchError`` naming the field, from the schedule and when the Lorsa objective is built; equal to
    ``top_k`` is no annealing, as documented."""
    for step in (0, 3, 99):
        with pytest.raises(ConfigMismatchError, match="LorsaRecipe.k_anneal_from=4 .*top_k=8"):
            k_schedule(step, 100, 8, LorsaRecipe(k_anneal_from=4))
    lorsa = Lorsa(LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=16, top_k=8))
    with pytest.raises(ConfigMismatchError, match="LorsaRecipe.k_anneal_from=7 .*top_k=8"):
        LorsaObjective(lorsa, recipe=LorsaRecipe(k_anneal_from=7))
    assert [k_schedule(s, 10, 8, LorsaRecipe(k_anneal_from=8)) for s in range(11)] == [8] * 11
    LorsaObjective(lorsa, recipe=LorsaRecipe(k_anneal_from=8))


def test_k_anneal_from_above_n_ov_heads_is_refused_when_the_objective_is_built():
    """``k_anneal_from > n_ov_heads`` failed only at the first training step, deep in ``Lorsa.activation`` after the
    recipe's initialisation had run (seen failing before the fix: no error at construction); now
    ``ConfigMismatchError`` naming both numbers when the objective is built. ``n_ov_heads`` itself anneals."""
    lorsa = Lorsa(LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=16, top_k=8))
    with pytest.raises(ConfigMismatchError, match="LorsaRecipe.k_anneal_from=17 .*n_ov_heads=16"):
        LorsaObjective(lorsa, recipe=LorsaRecipe(k_anneal_from=17))
    LorsaObjective(lorsa, recipe=LorsaRecipe(k_anneal_from=16))


# ------------------------------------------------------------------------------------------- references
def rms(q: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    if gain is None:
        return q
    return q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * gain


def rope(q: torch.Tensor, positions: torch.Tensor, rot: RotaryConfig | None) -> torch.Tensor:
    """Half-split RoPE (Su et al.; Llama's ``rotate_half``) of ``q (…, s, e)`` at ``positions (s,)``."""
    if rot is None:
        return q
    r = rot.rotary_dim
    inv = rot.base ** (-torch.arange(0, r, 2, dtype=D64) / r)
    ang = positions.to(D64)[:, None] * inv                       # (s, r/2)
    cos, sin = ang.cos(), ang.sin()
    a, b, rest = q[..., : r // 2], q[..., r // 2: r], q[..., r:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)


def mhsa_patterns(mhsa: MHSAWeights, x: torch.Tensor) -> torch.Tensor:
    """``(b, n_heads, s, s)``: each MHSA head's causal softmax pattern on raw ``x``, positions ``0 … s − 1``."""
    n, kv = mhsa.W_Q.shape[0], mhsa.W_K.shape[0]
    s = x.shape[1]
    pos = torch.arange(s)
    out = []
    for m in range(n):
        q = x @ mhsa.W_Q[m].to(D64) + mhsa.b_Q[m].to(D64)
        k = x @ mhsa.W_K[m // (n // kv)].to(D64) + mhsa.b_K[m // (n // kv)].to(D64)
        if mhsa.q_norm is not None:
            q, k = rms(q, mhsa.q_norm.to(D64), mhsa.qk_norm_eps), rms(k, mhsa.k_norm.to(D64), mhsa.qk_norm_eps)
        q, k = rope(q, pos, mhsa.rotary), rope(k, pos, mhsa.rotary)
        sc = (q @ k.transpose(-1, -2)) * mhsa.scale
        sc = sc.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -math.inf)
        out.append(sc.softmax(-1))
    return torch.stack(out, 1)


def mhsa_output(mhsa: MHSAWeights, x: torch.Tensor) -> torch.Tensor:
    pat = mhsa_patterns(mhsa, x)
    n, kv = mhsa.W_Q.shape[0], mhsa.W_K.shape[0]
    y = torch.zeros_like(x)
    for m in range(n):
        y = y + pat[:, m] @ (x @ mhsa.W_V[m // (n // kv)].to(D64)) @ mhsa.W_O[m].to(D64)
    return y


def principal(rows: torch.Tensor, n: int) -> torch.Tensor:
    """Top ``n`` right singular vectors of the demeaned ``rows``, each with its largest-magnitude entry positive."""
    r = rows - rows.mean(0)
    _, sv, vh = torch.linalg.svd(r, full_matrices=False)
    # the directions are defined only where the singular values are apart: skip draws where fp32 cannot resolve them
    gaps = (sv[:n] - sv[1: n + 1]) if sv.numel() > n else sv[:n] - torch.cat([sv[1:n], sv.new_zeros(1)])
    assume(bool((gaps > 1e-3 * sv[0]).all()))
    vh = vh[:n]
    sign = vh.gather(1, vh.abs().argmax(1, keepdim=True)).sign()
    return vh * sign


def unit(w: torch.Tensor) -> torch.Tensor:
    return w / w.norm(dim=-1, keepdim=True)


# ------------------------------------------------------------------------------------------- data
@st.composite
def init_cases(draw):
    n_kv = draw(st.sampled_from([1, 2]))
    n_heads = n_kv * draw(st.sampled_from([1, 2]))
    e = draw(st.sampled_from([2, 4, 6]))
    d = draw(st.sampled_from([8, 12, 16]))
    rep = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 2, 3]))
    rot = draw(st.sampled_from(["none", "full", "partial"]))
    qk_norm = draw(st.booleans())
    b = draw(st.integers(1, 3))
    s = draw(st.integers(6, 10))
    seed = draw(st.integers(0, 2 ** 16))
    lens = [draw(st.integers(3, s)) for _ in range(b)]
    n_ov = n_heads * rep * g
    top_k = draw(st.integers(1, n_ov))
    k_init = draw(st.one_of(st.none(), st.integers(1, n_ov)))          # the k in force at step 0 (annealing)
    recipe = LorsaRecipe(ov_init=draw(st.sampled_from(["value_svd", "output_svd", "mhsa"])),
                         center_b_v=draw(st.booleans()), scale_init=draw(st.booleans()),
                         b_d_init=draw(st.booleans()), scale_into=draw(st.sampled_from([None, "w_v"])))
    return dict(n_kv=n_kv, n_heads=n_heads, e=e, d=d, rep=rep, g=g, rot=rot, qk_norm=qk_norm, b=b, s=s, seed=seed,
                lens=lens, top_k=top_k, k_init=k_init, recipe=recipe)


def make_mhsa(c, gen: torch.Generator) -> MHSAWeights:
    n, kv, e, d = c["n_heads"], c["n_kv"], c["e"], c["d"]

    def r(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    rot = None if c["rot"] == "none" else RotaryConfig(head_dim=e, rotary_dim=e if c["rot"] == "full" else 2,
                                                        base=100.0)
    qn = (1 + 0.3 * r(e)) if c["qk_norm"] else None
    kn = (1 + 0.3 * r(e)) if c["qk_norm"] else None
    return MHSAWeights(W_Q=r(n, d, e, std=d ** -0.5), b_Q=r(n, e, std=0.1), W_K=r(kv, d, e, std=d ** -0.5),
                       b_K=r(kv, e, std=0.1), W_V=r(kv, d, e, std=d ** -0.5), b_V=torch.zeros(kv, e),
                       W_O=r(n, e, d, std=e ** -0.5), b_O=torch.zeros(d), rotary=rot, scale=e ** -0.5,
                       q_norm=qn, k_norm=kn)


def batch(c, mhsa: MHSAWeights, gen: torch.Generator):
    b, s, d = c["b"], c["s"], c["d"]
    x = torch.randn(b, s, d, generator=gen, dtype=D64)
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, n in enumerate(c["lens"]):
        mask[i, 1:n] = True                      # BOS out, right padding out
    pad = torch.zeros(b, s, dtype=torch.bool)
    for i, n in enumerate(c["lens"]):
        pad[i, n:] = True
    y = mhsa_output(mhsa, x) + 0.1 * torch.randn(b, s, d, generator=gen, dtype=D64)
    # garbage at the padded positions: causal attention keeps it out of every real token, loss_mask out of the fit
    x = torch.where(pad[..., None], 1e3 * torch.randn(b, s, d, generator=gen, dtype=D64), x)
    y = torch.where(pad[..., None], -1e3 * torch.ones_like(y), y)
    return x, y, mask


# ------------------------------------------------------------------------------------------- init
class MaxAlloc(TorchDispatchMode):
    """The largest tensor any op returns (bytes) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.max = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.max:
                self.max, self.op = t.numel() * t.element_size(), str(func)
        return out


def _init_lorsa_matches_the_reference(c):
    gen = torch.Generator().manual_seed(c["seed"])
    mhsa = make_mhsa(c, gen)
    x, y, mask = batch(c, mhsa, gen)
    assume(int(mask.sum()) >= c["e"] + 2)
    recipe = c["recipe"]
    event(f"ov_init={recipe.ov_init}")
    n, kv, e, d, rep, g = c["n_heads"], c["n_kv"], c["e"], c["d"], c["rep"], c["g"]
    cfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=n * rep * g, top_k=c["top_k"], qk_heads_per_mhsa_head=rep)
    lorsa = Lorsa(cfg)
    xr, yr = x[mask], y[mask]
    s_in = d ** 0.5 / float(xr.norm(dim=-1).mean())
    s_out = d ** 0.5 / float(yr.norm(dim=-1).mean())
    seed = c["seed"] + 1
    with MaxAlloc() as peak:
        info = init_lorsa(lorsa, x.float(), y.float(), mask, s_in=s_in, s_out=s_out, mhsa=mhsa, recipe=recipe,
                          top_k=c["k_init"], generator=torch.Generator().manual_seed(seed))
    W = {k: v.detach().to(D64) for k, v in lorsa.state_dict().items()}

    # memory: no intermediate above 2x the larger of the module, one batch-shaped activation, the attention scores
    b, s = x.shape[:2]
    module = sum(p.numel() * 4 for p in lorsa.parameters())
    acts = b * s * max(d, cfg.n_ov_heads, cfg.n_qk_heads * e) * 8
    scores = b * cfg.n_qk_heads * s * s * 8
    assert peak.max <= 2 * max(module, acts, scores), (peak.op, peak.max, module, acts, scores)

    # QK: head h is MHSA head h // rep (GQA: KV head (h // rep) // (n / kv)) acting on x · s_in
    for h in range(cfg.n_qk_heads):
        m = h // rep
        torch.testing.assert_close(W["W_Q"][h], mhsa.W_Q[m].to(D64) / s_in, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(W["W_K"][h], mhsa.W_K[m // (n // kv)].to(D64) / s_in, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(W["b_Q"][h], mhsa.b_Q[m].to(D64), rtol=0, atol=0)
        torch.testing.assert_close(W["b_K"][h], mhsa.b_K[m // (n // kv)].to(D64), rtol=0, atol=0)
    ref_pat = mhsa_patterns(mhsa, x)                                           # raw x
    with torch.no_grad():
        got_pat = lorsa.attention_pattern((x * s_in).float()).to(D64)          # normalised x
    for h in range(cfg.n_qk_heads):
        got, want = got_pat[:, h][mask], ref_pat[:, h // rep][mask]
        assert (got - want).abs().max() < 1e-4, (h, float((got - want).abs().max()))

    # OV, in the normalised space, from the draws in their documented order (u: init_from_mhsa; then c per head)
    rg = torch.Generator().manual_seed(seed)
    u = torch.randn(cfg.n_ov_heads, e, generator=rg)
    per = cfg.n_ov_heads // n
    xn = x * s_in
    w_v = torch.empty(cfg.n_ov_heads, d, dtype=D64)
    w_o = torch.empty(cfg.n_ov_heads, d, dtype=D64)
    for m in range(n):
        Wv = mhsa.W_V[m // (n // kv)].to(D64) / s_in
        Wo = mhsa.W_O[m].to(D64) * s_out
        rows = slice(m * per, (m + 1) * per)
        if recipe.ov_init == "mhsa":
            um = u[rows].to(D64)
            w_v[rows], w_o[rows] = um @ Wv.T, um @ (Wo / s_out)
            continue
        cm = torch.randn(per, e, generator=rg).to(D64)
        if recipe.ov_init == "value_svd":
            basis = principal((xn @ Wv @ Wv.T)[mask], e)
            w_v[rows] = cm @ basis
            w_o[rows] = w_v[rows] @ Wv @ Wo
        else:
            heads = ref_pat[:, m] @ (xn @ Wv) @ Wo                               # the head's outputs
            basis = principal(heads[mask], e)
            w_o[rows] = cm @ basis
            w_v[rows] = w_o[rows] @ (Wv @ Wo).T
    if recipe.ov_init == "mhsa":
        w_v = w_v * w_o.norm(dim=-1, keepdim=True)
        w_o = unit(w_o)
    else:
        w_v, w_o = unit(w_v), unit(w_o)
    b_v = torch.zeros(cfg.n_ov_heads, dtype=D64)
    group = torch.arange(cfg.n_ov_heads) // g                                  # OV head -> QK head

    def z_pre_of(wv, bv):
        val = xn @ wv.T + bv                                                   # (b, s, n_ov)
        return torch.stack([(ref_pat[:, int(group[h]) // rep] @ val[..., h, None])[..., 0]
                            for h in range(cfg.n_ov_heads)], -1)

    if recipe.center_b_v:
        b_v = b_v - z_pre_of(w_v, b_v)[mask].mean(0)
    yn = y * s_out
    zp = z_pre_of(w_v, b_v)
    idx = zp.topk(c["top_k"] if c["k_init"] is None else c["k_init"], -1).indices
    z = torch.zeros_like(zp).scatter(-1, idx, zp.gather(-1, idx).relu())
    D = (z @ w_o)[mask]
    t = yn[mask]
    fit = recipe.b_d_init
    Dc, tc = (D - D.mean(0), t - t.mean(0)) if fit else (D, t)
    scale = 1.0
    if recipe.scale_init and float(Dc.pow(2).sum()) > 0:
        scale = float((Dc * tc).sum() / Dc.pow(2).sum())
        scale = scale if scale > 0 else 1.0
    d_all = z @ w_o
    b_d = (t.mean(0) - scale * D.mean(0)) if fit else torch.zeros(d, dtype=D64)
    if recipe.scale_target == "w_o":
        w_o = w_o * scale
    else:
        w_v, b_v = w_v * scale, b_v * scale
    rel = 2e-3
    assert info["scale"] == pytest.approx(scale, rel=rel, abs=1e-6)
    for name, want in (("W_V", w_v), ("W_O", w_o), ("b_V", b_v), ("b_D", b_d)):
        got = W[name]
        assert (got - want).abs().max() <= rel * max(float(want.abs().max()), 1e-3), (name, got, want)
    # the forward after the init: the closed-form fit on the counted tokens, and the FVU it returns
    out = scale * d_all + b_d
    fvu = float((yn - out)[mask].pow(2).sum() / (t - t.mean(0)).pow(2).sum())
    assert info["fvu_init"] == pytest.approx(fvu, rel=5e-3, abs=1e-5)
    if recipe.scale_init and recipe.b_d_init and scale != 1.0:
        assert info["fvu_init"] <= 1 + 1e-4           # c* and b_D fit: never worse than predicting the mean


test_init_lorsa_matches_the_reference, test_init_lorsa_matches_the_reference_sweep = drawn(
    _init_lorsa_matches_the_reference, 25, 400, c=init_cases())


def test_init_lorsa_ignores_padded_tokens():
    """Garbage at padded (and BOS) positions, out of ``loss_mask``, changes nothing of the initialisation."""
    c = dict(n_kv=1, n_heads=2, e=4, d=12, rep=2, g=2, rot="full", qk_norm=False, b=3, s=9, seed=5, lens=[9, 5, 4],
             top_k=3, k_init=None)
    gen = torch.Generator().manual_seed(0)
    mhsa = make_mhsa(c, gen)
    x, y, mask = batch(c, mhsa, gen)
    got = []
    for fill in (0.0, 1e4):
        xx = torch.where(mask[..., None] | (torch.arange(9) < 1)[None, :, None], x, torch.full_like(x, fill))
        yy = torch.where(mask[..., None], y, torch.full_like(y, -fill))
        for ov_init in ("value_svd", "output_svd"):
            lorsa = Lorsa(LorsaConfig.from_mhsa(mhsa, n_ov_heads=8, top_k=3, qk_heads_per_mhsa_head=2))
            info = init_lorsa(lorsa, xx.float(), yy.float(), mask, s_in=0.7, s_out=1.3, mhsa=mhsa,
                              recipe=LorsaRecipe(ov_init=ov_init), generator=torch.Generator().manual_seed(1))
            got.append((info, lorsa.state_dict()))
    for (i0, s0), (i1, s1) in zip(got[:2], got[2:], strict=True):
        assert i0 == pytest.approx(i1, rel=1e-5)
        for k in s0:
            torch.testing.assert_close(s0[k], s1[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- dead heads
def dead_masks(n: int):
    """None dead, one, all, or a random subset."""
    return st.one_of(st.just(torch.zeros(n, dtype=torch.bool)), st.just(torch.ones(n, dtype=torch.bool)),
                     st.integers(0, n - 1).map(lambda i: torch.arange(n) == i),
                     st.lists(st.booleans(), min_size=n, max_size=n).map(lambda v: torch.tensor(v)))


@st.composite
def ghost_cases(draw):
    n, n_ov, d = draw(st.integers(1, 12)), draw(st.integers(1, 8)), draw(st.integers(2, 8))
    return n, n_ov, d, draw(dead_masks(n_ov)), draw(st.integers(0, 2 ** 16)), draw(st.sampled_from([0.5, 3.0, 40.0]))


def _ghost_loss_matches_ghost_grads(case):
    n, n_ov, d, dead, seed, spread = case
    g = torch.Generator().manual_seed(seed)
    z_pre = (spread * torch.randn(n, n_ov, generator=g, dtype=D64)).requires_grad_()
    W_O = torch.randn(n_ov, d, generator=g, dtype=D64).requires_grad_()
    err = torch.randn(n, d, generator=g, dtype=D64)
    got = ghost_loss(z_pre, dead, err, W_O)
    gz, gw = torch.autograd.grad(got, (z_pre, W_O), allow_unused=True)
    z2, w2 = z_pre.detach().clone().requires_grad_(), W_O.detach().clone().requires_grad_()
    ghost = torch.exp(z2[:, dead]) @ w2[dead]                                    # dead heads decode exp(z_pre)
    f = (err.norm(dim=-1, keepdim=True) / (2 * ghost.norm(dim=-1, keepdim=True))).detach()
    if not bool(dead.any()):
        f = torch.zeros_like(f)                                                  # no dead head: no ghost
    want = (ghost * f - err).pow(2).sum(-1).mean() / err.pow(2).sum(-1).mean()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-9, atol=1e-12)
    if bool(dead.any()):
        rz, rw = torch.autograd.grad(want, (z2, w2))
        for a, b in ((gz, rz), (gw, rw)):
            a = torch.zeros_like(b) if a is None else a
            assert (a - b).abs().max() <= 1e-8 * max(float(b.abs().max()), 1.0)
        assert not bool(gz[:, ~dead].any()) and not bool(gw[~dead].any())
    else:
        assert want.item() == pytest.approx(1.0)


test_ghost_loss_matches_ghost_grads, test_ghost_loss_matches_ghost_grads_sweep = drawn(
    _ghost_loss_matches_ghost_grads, 60, 1000, case=ghost_cases())


def small_lorsa(n_qk: int, g: int, d: int, e: int, top_k: int, seed: int, rotary: bool = False) -> Lorsa:
    torch.manual_seed(seed)
    rot = RotaryConfig(head_dim=e, rotary_dim=e, base=100.0) if rotary else None
    return Lorsa(LorsaConfig(d_model=d, n_qk_heads=n_qk, d_qk_head=e, n_ov_heads=n_qk * g, top_k=top_k, rotary=rot))


def lower_median(v: torch.Tensor) -> torch.Tensor:
    return v.sort().values[(v.numel() - 1) // 2]


@st.composite
def revive_cases(draw):
    n_qk, g = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    n_ov = n_qk * g
    return dict(n_qk=n_qk, g=g, d=draw(st.integers(2, 6)), n=draw(st.integers(1, 10)), k=draw(st.integers(1, n_ov)),
                dead=draw(dead_masks(n_ov)), seed=draw(st.integers(0, 2 ** 16)), by_norm=draw(st.booleans()),
                aim=draw(st.booleans()), margin=draw(st.sampled_from([0.0, 0.05, 0.5])), silent=draw(st.booleans()))


def margin_scale(top: torch.Tensor) -> float:
    """What ``revive_margin`` is a fraction of: the mean selected score over the batch's ``top (n, k)`` scores (ReLU'd:
    the mean active score); when the whole Lorsa is silent there (no selected score above 0) the mean ``|score|`` of
    the selected ones, so that the margin still lifts the head above 0; 1 when those are all exactly 0."""
    pos = float(top.clamp_min(0).mean())
    if pos > 0:
        return pos
    mag = float(top.abs().mean())
    return mag if mag > 0 else 1.0


def _revive_dead_matches_the_rule(c):
    lorsa = small_lorsa(c["n_qk"], c["g"], c["d"], 2, c["k"], c["seed"])
    n_ov, dead, k = lorsa.cfg.n_ov_heads, c["dead"], c["k"]
    gen = torch.Generator().manual_seed(c["seed"])
    with torch.no_grad():
        lorsa.W_V.mul_(torch.rand(n_ov, 1, generator=gen) * 3)                 # unequal ‖w_v‖
        lorsa.b_V.copy_(torch.randn(n_ov, generator=gen))
        lorsa.W_O.mul_(0.5 + torch.rand(n_ov, 1, generator=gen))
    z_pre = torch.randn(c["n"], n_ov, generator=gen) - 2 * dead.float()        # dead heads mostly negative
    if c["silent"]:                                                            # the whole Lorsa silent on the batch
        z_pre = -z_pre.abs() - 0.01
    err = torch.randn(c["n"], c["d"], generator=gen)
    before = {k_: v.detach().clone().to(D64) for k_, v in lorsa.state_dict().items()}
    norms = lorsa.W_O.detach().norm(dim=1) if c["by_norm"] else None
    idx = revive_dead(lorsa, z_pre, dead, k, c["margin"], norms, err if c["aim"] else None)
    assert idx.tolist() == dead.nonzero().flatten().tolist()
    W = {k_: v.detach().to(D64) for k_, v in lorsa.state_dict().items()}
    # reference, in fp64
    zp = z_pre.to(D64)
    unit_n = torch.ones(n_ov, dtype=D64) if norms is None else norms.to(D64)
    top = (zp * unit_n).topk(k, -1).values
    thr = top[:, -1].clamp_min(0)
    wn = before["W_V"].norm(dim=1)
    cap = lower_median(wn[~dead]) if bool((~dead).any()) else lower_median(wn)
    want = {k_: v.clone() for k_, v in before.items()}
    for h in dead.nonzero().flatten().tolist():
        f = min(1.0, float(cap / wn[h]))
        gaps = thr / unit_n[h] - f * zp[:, h]
        best = int(gaps.argmin())
        push = max(float(gaps[best]), 0.0) + c["margin"] * margin_scale(top) / float(unit_n[h])
        want["W_V"][h] = f * before["W_V"][h]
        want["b_V"][h] = f * before["b_V"][h] + push
        if c["aim"]:
            want["W_O"][h] = unit(err[best].to(D64)) * before["W_O"][h].norm()
        # the point of it: the head's new score at its best token reaches the old k-th score (and is positive)
        new = (f * zp[best, h] + push) * unit_n[h]
        assert new >= thr[best] - 1e-5
        if c["margin"] > 0:                     # past the threshold and above 0 (it fires), silent Lorsa or not
            assert new > thr[best] and new >= c["margin"] * margin_scale(top) * (1 - 1e-5) - 1e-6
    for name in want:
        assert (W[name] - want[name]).abs().max() <= 1e-5 * max(float(want[name].abs().max()), 1.0), name


test_revive_dead_matches_the_rule, test_revive_dead_matches_the_rule_sweep = drawn(
    _revive_dead_matches_the_rule, 60, 1000, c=revive_cases())


@st.composite
def silent_cases(draw):
    n_qk, g = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    return dict(n_qk=n_qk, g=g, d=draw(st.integers(2, 6)), b=draw(st.integers(1, 3)), s=draw(st.integers(1, 6)),
                k=draw(st.integers(1, n_qk * g)), dead=draw(st.integers(0, n_qk * g - 1)),
                seed=draw(st.integers(0, 2 ** 16)), by_norm=draw(st.booleans()),
                margin=draw(st.sampled_from([1e-3, 0.05, 0.5])), depth=draw(st.sampled_from([0.01, 1.0, 30.0])))


def _a_revived_head_fires_when_the_whole_lorsa_is_silent(c):
    """Every head's pre-activation negative on every token of the batch (the whole Lorsa silent): the revived head
    fires, through the Lorsa's own forward, on its best token. Before the fix the margin was a fraction of the mean
    selected score — 0 here — and the head was lifted to exactly 0 (ReLU: silent, dead again)."""
    lorsa = small_lorsa(c["n_qk"], c["g"], c["d"], 2, c["k"], c["seed"])
    n_ov = lorsa.cfg.n_ov_heads
    x = torch.randn(c["b"], c["s"], c["d"], generator=torch.Generator().manual_seed(c["seed"]))
    with torch.no_grad():
        z0 = lorsa.compute_z_pre(x).flatten(0, 1)
        lorsa.b_V.sub_(z0.amax(0) + c["depth"])                                # every z_pre at most −depth
        z_pre = lorsa.compute_z_pre(x).flatten(0, 1)
    assert bool((z_pre < 0).all())
    dead = torch.arange(n_ov) == c["dead"]
    norms = lorsa.W_O.detach().norm(dim=1) if c["by_norm"] else None
    idx = revive_dead(lorsa, z_pre, dead, c["k"], c["margin"], norms)
    assert idx.tolist() == [c["dead"]]
    with torch.no_grad():
        z, _ = lorsa.activation(lorsa.compute_z_pre(x), c["k"])
    assert float(z.flatten(0, 1)[:, c["dead"]].max()) > 0, "the revived head does not fire"


test_a_revived_head_fires_when_the_whole_lorsa_is_silent, test_a_revived_head_fires_when_silent_sweep = drawn(
    _a_revived_head_fires_when_the_whole_lorsa_is_silent, 40, 500, c=silent_cases())


@st.composite
def resample_cases(draw):
    n_qk, g = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    b, s = draw(st.integers(1, 3)), draw(st.integers(2, 7))
    return dict(n_qk=n_qk, g=g, d=draw(st.integers(2, 6)), e=draw(st.sampled_from([2, 4])), b=b, s=s,
                lens=[draw(st.integers(2, s)) for _ in range(b)], dead=draw(dead_masks(n_qk * g)),
                seed=draw(st.integers(0, 2 ** 16)), rotary=draw(st.booleans()))


def _resample_dead_matches_the_rule_off_padding(c):
    lorsa = small_lorsa(c["n_qk"], c["g"], c["d"], c["e"], 1, c["seed"], c["rotary"])
    n_ov, dead = lorsa.cfg.n_ov_heads, c["dead"]
    gen = torch.Generator().manual_seed(c["seed"])
    b, s, d = c["b"], c["s"], c["d"]
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, n in enumerate(c["lens"]):
        mask[i, 1:n] = True
    pad = ~mask
    pad[:, 0] = False
    x = torch.randn(b, s, d, generator=gen)
    err = torch.randn(b, s, d, generator=gen)
    x = torch.where(pad[..., None], torch.full_like(x, 1e3), x)                # garbage where padded
    err = torch.where(~mask[..., None], 1e4 * torch.randn(b, s, d, generator=gen), err)      # and at BOS
    with torch.no_grad():
        lorsa.W_V.mul_(torch.rand(n_ov, 1, generator=gen) * 3)
    before = {k_: v.detach().clone().to(D64) for k_, v in lorsa.state_dict().items()}
    idx = resample_dead(lorsa, x, err, mask, dead, torch.Generator().manual_seed(7))
    one = int(mask.sum()) == 1           # one counted token: no direction; the heads are left and not reported
    assert idx.tolist() == ([] if one else dead.nonzero().flatten().tolist())
    W = {k_: v.detach().to(D64) for k_, v in lorsa.state_dict().items()}
    want = {k_: v.clone() for k_, v in before.items()}
    if bool(dead.any()) and not one:
        e = err[mask].to(D64)                                                    # counted tokens, row-major
        pick = torch.multinomial((e.pow(2).sum(-1) / e.pow(2).sum()).float(), int(dead.sum()), replacement=True,
                                 generator=torch.Generator().manual_seed(7))
        # the QK groups' attention-weighted inputs, from the Lorsa's own QK weights (causal softmax, RoPE)
        xd = x.to(D64)
        pos = torch.arange(s)
        xbar = []
        for q_h in range(c["n_qk"]):
            q = rope(xd @ before["W_Q"][q_h] + before["b_Q"][q_h], pos, lorsa.cfg.rotary)
            kk = rope(xd @ before["W_K"][q_h] + before["b_K"][q_h], pos, lorsa.cfg.rotary)
            sc = (q @ kk.transpose(-1, -2) / lorsa.cfg.scale).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(),
                                                                         -math.inf)
            xbar.append(sc.softmax(-1) @ xd)                                      # (b, s, d)
        counted = [xb[mask] for xb in xbar]                                       # (n, d) per QK group
        wn = before["W_V"].norm(dim=1)
        med = lower_median(wn[~dead]) if bool((~dead).any()) else lower_median(wn)
        for j, h in enumerate(dead.nonzero().flatten().tolist()):
            grp = h // c["g"]
            mu = counted[grp].mean(0)
            dirn = counted[grp][int(pick[j])] - mu
            w_v = dirn / dirn.norm() * med
            want["W_V"][h] = w_v
            want["b_V"][h] = -(mu @ w_v) - 0.5 * (dirn @ w_v)
            want["W_O"][h] = unit(e[int(pick[j])])
            # never a padded (or BOS) token: w_o is the error direction at a counted token
            cos = unit(err.to(D64)) @ W["W_O"][h]
            best = float(cos[mask].max())
            assert best > 1 - 1e-5 and best >= float(cos[~mask].max())          # ~mask: BOS at least
    for name in want:
        assert (W[name] - want[name]).abs().max() <= 2e-4 * max(float(want[name].abs().max()), 1.0), name


test_resample_dead_matches_the_rule_off_padding, test_resample_dead_matches_the_rule_off_padding_sweep = drawn(
    _resample_dead_matches_the_rule_off_padding, 60, 1000, c=resample_cases())


@st.composite
def one_token_cases(draw):
    n_qk, g = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    return dict(n_qk=n_qk, g=g, d=draw(st.integers(2, 6)), b=b, s=s, at=(draw(st.integers(0, b - 1)),
                draw(st.integers(0, s - 1))), dead=draw(dead_masks(n_qk * g).filter(lambda m: bool(m.any()))),
                seed=draw(st.integers(0, 2 ** 16)), rotary=draw(st.booleans()))


def _resample_dead_with_one_counted_token_leaves_no_zero_w_v(c):
    """One counted token: its attended input centred over the counted tokens is 0 — no direction. Before the fix the
    dead heads were given ``w_v = 0`` (and ``b_v = 0``: never firing again) and reported as re-initialised, so the
    caller reset their dead counters; now they are left as they were and not reported (the next batch retries)."""
    lorsa = small_lorsa(c["n_qk"], c["g"], c["d"], 2, 1, c["seed"], c["rotary"])
    gen = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(c["b"], c["s"], c["d"], generator=gen)
    err = torch.randn(c["b"], c["s"], c["d"], generator=gen)
    mask = torch.zeros(c["b"], c["s"], dtype=torch.bool)
    mask[c["at"]] = True
    before = {k_: v.detach().clone() for k_, v in lorsa.state_dict().items()}
    idx = resample_dead(lorsa, x, err, mask, c["dead"], torch.Generator().manual_seed(3))
    moved = torch.zeros_like(c["dead"])
    moved[idx] = True
    assert not bool((moved & ~c["dead"]).any())
    for h in range(lorsa.cfg.n_ov_heads):
        if bool(moved[h]):                                   # a re-initialised head has a real value direction
            assert float(lorsa.W_V[h].norm()) > 0.5 * float(before["W_V"].norm(dim=1).min()), h
        else:                                                # the others are untouched
            for name in ("W_V", "b_V", "W_O"):
                assert torch.equal(lorsa.state_dict()[name][h], before[name][h]), (h, name)


test_resample_dead_with_one_counted_token_leaves_no_zero_w_v, test_resample_one_token_sweep = drawn(
    _resample_dead_with_one_counted_token_leaves_no_zero_w_v, 30, 300, c=one_token_cases())


@st.composite
def balance_cases(draw):
    n_ov = draw(st.integers(1, 8))
    total = draw(st.integers(1, 12))
    recipe = LorsaRecipe(dead_remedy="balance", balance_floor=draw(st.sampled_from([0.1, 0.5, 1.0])),
                         balance_rate=draw(st.sampled_from([0.05, 0.3])), balance_ema=draw(st.sampled_from([0.1, 1.0])),
                         balance_max=draw(st.sampled_from([0.1, 0.5, 2.0])),
                         remedy_until=draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])), balance_hold=draw(st.booleans()))
    return dict(n_ov=n_ov, k=draw(st.integers(1, n_ov)), total=total, recipe=recipe,
                seed=draw(st.integers(0, 2 ** 16)), n_tok=draw(st.integers(0, 20)),
                dead=[draw(dead_masks(n_ov)) for _ in range(total)])


def _head_balance_matches_the_gains(c):
    n_ov, k, total, r = c["n_ov"], c["k"], c["total"], c["recipe"]
    lorsa = small_lorsa(1, n_ov, 4, 2, k, c["seed"])
    gen = torch.Generator().manual_seed(c["seed"])
    bal = HeadBalance(n_ov, k)
    # the firing-rate EMA in fp32, as stored (so that a rate exactly at the floor is compared as the code sees it)
    freq = torch.full((n_ov,), k / n_ov, dtype=torch.float32)
    log_gain = torch.zeros(n_ov, dtype=D64)
    b_v = lorsa.b_V.detach().clone().to(D64)
    at_stop = None
    stop = r.remedy_until * total
    floor = r.balance_floor * k / n_ov
    for step in range(total):
        n = c["n_tok"]
        counts = torch.randint(0, n + 1, (n_ov,), generator=gen) * (~c["dead"][step])   # the dead never fire
        z_max = torch.randn(n_ov, generator=gen) - 1.5 * c["dead"][step].float()
        bal.update(lorsa, r, counts, z_max, n, step, total)
        freq = freq * (1 - r.balance_ema) + r.balance_ema * counts.float() / max(n, 1)
        if step < stop:
            under = freq < floor                                                 # at the floor: not under
            if bool((freq == torch.tensor(floor, dtype=torch.float32)).any()):
                event("a rate exactly at the floor")
            log_gain = (log_gain + torch.where(under, r.balance_rate, -r.balance_rate)).clamp(0, r.balance_max)
            stuck = under & (z_max.to(D64) <= 0) & (log_gain >= r.balance_max - 1e-12)
            lift = -z_max.to(D64) + 1e-3 * float(z_max.clamp_min(0).max())
            b_v = b_v + torch.where(stuck, lift, 0.0)
            if bool(stuck.any()):
                event("a stuck head lifted")
        else:
            if at_stop is None:
                at_stop = log_gain.clone()
            if not r.balance_hold:
                log_gain = at_stop * max(0.0, (total - step - 1) / max(total - stop, 1.0))
        torch.testing.assert_close(bal.freq, freq, rtol=0, atol=0)
        torch.testing.assert_close(bal.log_gain.to(D64), log_gain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lorsa.b_V.detach().to(D64), b_v, rtol=1e-5, atol=1e-5)
        assert (bal.at_stop is None) == (at_stop is None)
    if at_stop is not None and not r.balance_hold:
        assert float(log_gain.abs().max()) == 0.0 and float(bal.log_gain.abs().max()) == 0.0  # gains 1 at the end


test_head_balance_matches_the_gains, test_head_balance_matches_the_gains_sweep = drawn(
    _head_balance_matches_the_gains, 60, 1000, c=balance_cases())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("level", [-30.0, -100.0, -1000.0])
def test_ghost_grads_reach_a_head_however_negative(dtype, level):
    """The docstring's "a gradient at any pre-activation": the ghost is rescaled to half the error's norm per token,
    so how negative ``z_pre`` is must not matter (below about −28 the clamp of the ghost's norm at 1e-12 zeroed the
    rescaled ghost, below −87 in fp32 ``exp`` itself underflowed: no gradient)."""
    g = torch.Generator().manual_seed(0)
    z_pre = (level + torch.randn(5, 3, generator=g)).to(dtype).requires_grad_()
    W_O = torch.nn.functional.normalize(torch.randn(3, 4, generator=g), dim=-1).to(dtype).requires_grad_()
    err = torch.randn(5, 4, generator=g).to(dtype)
    dead = torch.tensor([True, False, True])
    loss = ghost_loss(z_pre, dead, err, W_O)
    loss.backward()
    shifted = ghost_loss(z_pre.detach() - level, dead, err, W_O.detach())    # the same heads, pre-activations near 0
    assert float(loss.detach()) == pytest.approx(float(shifted), rel=1e-4)
    assert bool((z_pre.grad[:, dead].abs().sum(0) > 0).all()) and bool((W_O.grad[dead].abs().sum(-1) > 0).all())


ATTN = {"neox": "gpt_neox.layers.{}.attention", "gpt2": "transformer.h.{}.attn"}


def family_patterns(family: str, layer: int, seed: int = 0):
    """A tiny model's attention input ``x`` at ``layer`` and its heads' softmax patterns (transformers' eager
    attention, ``output_attentions``) on random windows, read with a plain forward pre-hook."""
    from helpers import random_ids, tiny_nnsight

    from nnsight_lorsa import get_adapter

    model, hf = tiny_nnsight(family, seed)
    got = {}
    mod = hf.get_submodule(ATTN.get(family, "model.layers.{}.self_attn").format(layer))
    def read(m, a, kw):
        got["x"] = a[0] if a else kw["hidden_states"]

    h = mod.register_forward_pre_hook(read, with_kwargs=True)
    try:
        with torch.no_grad():
            out = hf(random_ids(batch=2, seq=9, seed=seed + 1), output_attentions=True)
    finally:
        h.remove()
    adapter = get_adapter(model)
    return adapter.mhsa_weights(hf, layer), got["x"].detach(), out.attentions[layer].detach()


# global layers only: a Lorsa attends globally (docs/adapters.md), so sliding layers are left out; OLMo-2's QK-norm
# spans the whole projection and the Lorsa's is per head (init_from_mhsa: "near, not at"); Gemma-2 soft-caps
FAMILY_LAYERS = [("llama", 1), ("qwen2", 1), ("qwen3", 1), ("neox", 1), ("gpt2", 1), ("gemma3", 1), ("gemma", 1)]


@pytest.mark.parametrize("family,layer", FAMILY_LAYERS)
def test_init_lorsa_qk_heads_attend_as_the_models_heads(family, layer):
    """After ``init_lorsa`` (on ``x · s_in``), QK head ``h`` attends exactly as the model's head ``h // rep``
    (GQA, RoPE convention, QK-norm, score scale), against the model's own eager attention probabilities."""
    mhsa, x, probs = family_patterns(family, layer)
    rep = 2
    lorsa = Lorsa(LorsaConfig.from_mhsa(mhsa, n_ov_heads=mhsa.n_heads * rep * 2, top_k=2, qk_heads_per_mhsa_head=rep))
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    mask[:, 0] = False
    s_in = 0.37
    init_lorsa(lorsa, x, torch.randn_like(x), mask, s_in=s_in, s_out=2.0, mhsa=mhsa,
               generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pat = lorsa.attention_pattern(x * s_in)
    for h in range(lorsa.cfg.n_qk_heads):
        diff = float((pat[:, h] - probs[:, h // rep]).abs().max())
        assert diff < 2e-5, (family, h, diff)


def test_head_balance_gain_falls_for_a_head_exactly_at_the_floor():
    """A head's log-gain "rises ... while its firing rate is below ``balance_floor · k / n_ov`` and falls
    otherwise": exactly at the floor it falls."""
    lorsa = small_lorsa(1, 2, 4, 2, 1, 0)
    r = LorsaRecipe(balance_floor=1.0, balance_ema=1.0, balance_rate=0.25, balance_max=1.0)
    bal = HeadBalance(2, 1)
    bal.log_gain.fill_(0.5)
    bal.update(lorsa, r, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]), 2, 0, 10)   # rates 0.5 (= floor), 0
    assert bal.log_gain.tolist() == [0.25, 0.75]


# values of the annotated types (the test-time type hook refuses the others before the recipe's own checks)
BAD_RECIPE_VALUES = {
    "k_anneal_from": [0, -4, True],
    "init_windows": [0, -1, True],
    "k_anneal_frac": [-0.1, 1.5, float("nan")],
    "remedy_until": [-0.5, 1.01, float("nan"), float("inf")],
    "ghost_coef": [-1.0, float("nan"), float("inf")],
    "revive_margin": [-0.05, float("nan")],
}


@pytest.mark.parametrize("field_value", [(f, v) for f, vs in BAD_RECIPE_VALUES.items() for v in vs], ids=repr)
def test_a_recipe_with_an_out_of_range_setting_is_refused_naming_it(field_value):
    """Out-of-range counts, fractions and weights were taken without a word (``init_windows=-1`` dropped the last
    window, ``ghost_coef=-1`` switched ghost grads off, ``revive_margin < 0`` revived heads short of the threshold)."""
    name, value = field_value
    with pytest.raises(ConfigMismatchError, match=f"LorsaRecipe.{name}"):
        LorsaRecipe(**{name: value})


def test_in_range_recipe_settings_are_accepted():
    LorsaRecipe(k_anneal_from=64, init_windows=1, k_anneal_frac=0.0, remedy_until=0.0, ghost_coef=0.0,
                revive_margin=0.0)
    LorsaRecipe(k_anneal_from=17, init_windows=3, k_anneal_frac=1.0, remedy_until=1.0, ghost_coef=2.5,
                revive_margin=1.0)
