"""Probe of the analysis functions' numbers against references written here from the definitions (Lorsa paper
§5.1 z-pattern, App. E.1 oblique projection, Fig. 4 OV logit lens) and plain PyTorch forward hooks on the tiny
models (no nnsight in the references). docs/reliability.md, "Analysis numbers probe (2026-11-27)".

* ``collect_top_activations`` / ``TopActivations``: values, (window, position), counts and ``n_tokens`` against a
  brute-force pass over the whole corpus' ``z`` captured by a forward hook (tie-robust: every returned entry must
  hold its value in the reference, entries are distinct, and nothing strictly above the last kept value is missing);
* ``Lorsa.z_pattern`` / ``attention_pattern``: against ``softmax(q kᵀ / scale)`` with the causal + key-padding mask
  written out (GPT-2: no RoPE), and ``Σ_j zp_ij = z_pre_i`` against ``hook_z_pre`` of the hooked model (padding,
  batch > 1, position offsets, RoPE families, fp32 / bf16);
* ``mhsa_correlation``: against per-token least squares (fp64) of each MHSA head's output, read from the
  output projection's input by a forward hook, on the active Lorsa heads' ``z_h w_o^h``;
* ``ov_logit_lens``: against ``W_U (g ⊙ w_o)`` written per family (final norm gain, Gemma ``1 + w``, OLMo-2 / Gemma
  post-attention norm);
* the dashboard's per-token contributions: they sum to the listed ``z`` and equal the hand z-pattern.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import LAYER, VOCAB, hooked, make_lorsa, tiny_nnsight
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis import collect_top_activations, mhsa_correlation, ov_logit_lens

_MODELS: dict = {}


def _generated(body, strategies: dict, n: int):
    """``body`` as a hypothesis test of ``n`` drawn cases (the default run's few, the ``slow`` sweep's many)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(**strategies)(body))


def _setup(family: str, layer: int = LAYER, dtype: torch.dtype = torch.float32):
    key = (family, layer, dtype)
    if key not in _MODELS:
        model, hf = tiny_nnsight(family, dtype=dtype)
        adapter = get_adapter(model)
        lorsa = make_lorsa(hf, adapter, layer=layer).to(dtype)
        _MODELS[key] = (model, hf, adapter, lorsa, ReplacementModel(model, lorsas=LorsaSet(model, {layer: lorsa})))
    return _MODELS[key]


def _ids(n: int, pos: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, pos), generator=g)
    ids[:, 0] = 0
    return ids


@contextlib.contextmanager
def _capture_z(hf, adapter, layer, lorsa, store: list, key_mask=None):
    """The spliced Lorsa's ``z`` at ``layer`` through the plain-hook reference splice (helpers.hooked)."""
    def edit(z):
        store.append(z.detach().clone())
        return z
    with hooked(hf, adapter, {layer: lorsa}, edit=edit, key_mask=key_mask):
        yield


@torch.no_grad()
def _reference_z(family: str, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    _, hf, adapter, lorsa, _ = _setup(family, dtype=dtype)
    store: list = []
    with _capture_z(hf, adapter, LAYER, lorsa, store):
        hf(ids)
    return store[0].float()  # (n, pos, n_ov)


@torch.no_grad()
def _attention_input(hf, adapter, ids: torch.Tensor) -> torch.Tensor:
    """The input of layer ``LAYER``'s attention in a plain forward of ``ids`` (a forward hook, no nnsight)."""
    xs: list = []
    handle = adapter.attention_module(hf, LAYER).register_forward_hook(
        lambda m, a, kw, o: xs.append(adapter.attention_input(a, kw)), with_kwargs=True)
    try:
        hf(ids)
    finally:
        handle.remove()
    return xs[0]


def _check_top(top, z: torch.Tensor, n_top: int, skip_start: int, distinct: bool, tol: float) -> None:
    """``top`` against the brute-force definition on the reference ``z`` (n, pos, heads)."""
    n, pos, heads = z.shape
    kept = z[:, skip_start:]  # (n, pos - skip, heads)
    assert top.n_tokens == n * (pos - skip_start)
    assert torch.equal(top.count, (kept > 0).sum((0, 1))), "active counts"
    for h in range(heads):
        # distinct: each window's best kept position, then the best windows
        cand = kept[..., h].max(1).values if distinct else kept[..., h].reshape(-1)
        want = cand.sort(descending=True).values[:n_top]
        m = want.numel()
        got_v, got_w, got_p = top.values[h], top.window[h], top.position[h]
        assert torch.allclose(got_v[:m], want, atol=tol, rtol=0), (h, got_v, want)
        assert bool((got_v[m:] == float("-inf")).all()) and bool((got_w[m:] == -1).all())
        assert bool((got_p[m:] == -1).all())
        pairs = list(zip(got_w[:m].tolist(), got_p[:m].tolist(), strict=True))
        assert len(set(pairs)) == m, f"head {h}: a (window, position) twice: {pairs}"
        if distinct:
            assert len({w for w, _ in pairs}) == m, f"head {h}: a window twice: {pairs}"
        for (w, p), v in zip(pairs, got_v[:m].tolist(), strict=True):
            assert 0 <= w < n and skip_start <= p < pos, (h, w, p)
            assert abs(float(z[w, p, h]) - v) <= tol, f"head {h}: entry ({w}, {p}) holds {float(z[w, p, h])}, not {v}"
            if distinct:  # the window's largest kept activation
                assert abs(float(kept[w, :, h].max()) - v) <= tol, (h, w, p, v)
        # values == the sorted top-m of the definition, at m distinct places that hold them: nothing left out


_TOP = dict(n=st.integers(1, 6), pos=st.integers(2, 10), n_top=st.integers(1, 9), batch_size=st.integers(1, 7),
       skip=st.integers(0, 3), distinct=st.booleans(),
       family=st.sampled_from(["llama", "gpt2", "gemma2", "qwen3", "neox", "olmo2", "phi3", "gemma"]),
       seed=st.integers(0, 2**16))


def _top_case(n, pos, n_top, batch_size, skip, distinct, family, seed):
    """``collect_top_activations`` over several batches == the top-``n_top`` of the whole corpus' ``z`` captured by
    a forward hook (values, their (window, position), active counts, tokens counted), ties allowed either way."""
    skip = min(skip, pos - 1)
    _, _, _, lorsa, rm = _setup(family)
    ids = _ids(n, pos, seed)
    z = _reference_z(family, ids)
    top = collect_top_activations(rm, LAYER, ids, n_top=n_top, batch_size=batch_size, skip_start=skip,
                                  distinct_windows=distinct)
    scale = max(float(z.abs().max()), 1e-30)
    _check_top(top, z, n_top, skip, distinct, 1e-5 * scale)


test_top_activations_match_a_brute_force_pass = _generated(_top_case, _TOP, 12)
test_sweep_top_activations_match_a_brute_force_pass = pytest.mark.slow(_generated(_top_case, _TOP, 1000))


def test_top_activations_with_ties_and_a_bf16_model():
    """All-zero heads (ties at 0 everywhere: dead or never in the top-k) and a bf16 model: still the definition."""
    _, _, _, lorsa, rm = _setup("llama", dtype=torch.bfloat16)
    ids = _ids(5, 9, 3)
    z = _reference_z("llama", ids, torch.bfloat16)
    assert bool(((z[:, 1:] > 0).sum((0, 1)) == 0).any()), "the case needs a head that never fires"
    for distinct in (False, True):
        top = collect_top_activations(rm, LAYER, ids, n_top=4, batch_size=2, distinct_windows=distinct)
        _check_top(top, z, 4, 1, distinct, 1e-2 * float(z.abs().max()))



_UPDATES = dict(n_heads=st.integers(1, 4), n_top=st.integers(1, 6), distinct=st.booleans(),
                batches=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 6), st.integers(0, 2**16)),
                                 min_size=1, max_size=5), pos=st.integers(1, 5), levels=st.sampled_from([3, 1000]))


def _updates_case(n_heads, n_top, distinct, batches, pos, levels):
    """``TopActivations.update`` streamed over batches (overlapping windows when ``distinct``: the same window given
    again, with other values) with few value levels (ties) and random keep masks == the definition on everything
    given: per window its largest kept value (distinct) or every kept token, the top ``n_top`` of those."""
    from nnsight_lorsa.analysis import TopActivations

    top = TopActivations.empty(n_heads, n_top, distinct_windows=distinct)
    seen: dict = {}  # (window, position) -> list of value vectors (n_heads,) given there
    n_tokens, count = 0, torch.zeros(n_heads, dtype=torch.long)
    nxt = 0
    for b, first, seed in batches:
        g = torch.Generator().manual_seed(seed)
        first = first if distinct else nxt  # without distinct_windows a window is given once
        nxt = first + b
        z = torch.randint(0, levels, (b, pos, n_heads), generator=g).float() / levels - 0.2
        keep = torch.rand(b, pos, generator=g) > 0.3
        top.update(z, first, keep)
        n_tokens += int(keep.sum())
        count += ((z > 0) & keep[..., None]).sum((0, 1))
        for r, p in keep.nonzero().tolist():
            seen.setdefault((first + r, p), []).append(z[r, p])
    assert top.n_tokens == n_tokens and torch.equal(top.count, count)
    for h in range(n_heads):
        per_loc = {k: max(float(v[h]) for v in vals) for k, vals in seen.items()}
        if distinct:
            best: dict = {}
            for (w, _), v in per_loc.items():
                best[w] = max(best.get(w, float("-inf")), v)
            cand = sorted(best.values(), reverse=True)
        else:
            cand = sorted(per_loc.values(), reverse=True)
        m = min(n_top, len(cand))
        got_v, got_w, got_p = top.values[h].tolist(), top.window[h].tolist(), top.position[h].tolist()
        assert got_v[:m] == pytest.approx(cand[:m], abs=1e-6), (h, got_v, cand)
        assert all(v == float("-inf") for v in got_v[m:]) and all(w == -1 for w in got_w[m:])
        pairs = list(zip(got_w[:m], got_p[:m], strict=True))
        assert len(set(pairs)) == m and (not distinct or len({w for w, _ in pairs}) == m), pairs
        for (w, p), v in zip(pairs, got_v[:m], strict=True):
            assert (w, p) in per_loc and abs(per_loc[(w, p)] - v) <= 1e-6, (h, w, p, v)


test_top_activations_updates_by_definition = _generated(_updates_case, _UPDATES, 60)
test_sweep_top_activations_updates_by_definition = pytest.mark.slow(_generated(_updates_case, _UPDATES, 3000))

# ------------------------------------------------------------------ z-pattern
def _hand_pattern(lorsa, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``A[b, g, i, j] = softmax_j(q_i·k_j / scale)`` over ``j ≤ i`` with ``mask[b, j]`` (a row with no key: itself),
    in fp64, for a Lorsa without RoPE / QK-norm."""
    c = lorsa.cfg
    assert c.rotary is None and not c.qk_norm
    xd = x.double()
    q = torch.einsum("bsd,gde->bgse", xd, lorsa.W_Q.double()) + lorsa.b_Q.double()[None, :, None]
    k = torch.einsum("bsd,gde->bgse", xd, lorsa.W_K.double()) + lorsa.b_K.double()[None, :, None]
    s = x.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    allowed = allowed | (~allowed.any(-1, keepdim=True) & torch.eye(s, dtype=torch.bool))
    scores = (q @ k.transpose(-1, -2)) / c.scale
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1)


@torch.no_grad()
def test_z_pattern_against_the_definition_with_padding():
    """GPT-2 (no RoPE): ``attention_pattern`` and ``z_pattern`` == the hand softmax × ``v`` with a left-padded batch;
    ``Σ_j zp_ij`` == the ``z_pre`` the plain-hook splice computes on the padded model input."""
    model, hf, adapter, lorsa, _ = _setup("gpt2")
    ids = _ids(3, 8, 11)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    xs: list = []
    handle = adapter.attention_module(hf, LAYER).register_forward_hook(
        lambda m, a, kw, o: xs.append(adapter.attention_input(a, kw)), with_kwargs=True)
    store: list = []
    pre: list = []
    own = lorsa.compute_z_pre  # the splice's z_pre, as the plain-hook reference computes it on the model's mask
    lorsa.compute_z_pre = lambda *a, **kw: pre.append(own(*a, **kw)) or pre[-1]
    try:
        with _capture_z(hf, adapter, LAYER, lorsa, store, key_mask=mask):
            hf(ids, attention_mask=mask)
    finally:
        handle.remove()
        del lorsa.compute_z_pre
    x = xs[0]
    want_a = _hand_pattern(lorsa, x, mask)
    got_a = lorsa.attention_pattern(x, attn_mask=mask)
    real = mask.bool()  # rows of padding queries are left out: what they attend to is a convention
    torch.testing.assert_close(got_a.double().permute(0, 2, 1, 3)[real], want_a.permute(0, 2, 1, 3)[real],
                               atol=1e-5, rtol=0)
    heads = [0, 5, 17, lorsa.cfg.n_ov_heads - 1]
    zp = lorsa.z_pattern(x, heads, attn_mask=mask)
    v = x.double() @ lorsa.W_V.double().T + lorsa.b_V.double()
    g = torch.tensor(heads) // lorsa.cfg.group_size
    want_zp = want_a[:, g] * v[..., heads].transpose(1, 2)[:, :, None, :]
    scale = float(want_zp.abs().max())
    assert float((zp.double() - want_zp).permute(0, 2, 1, 3)[real].abs().max()) <= 1e-5 * scale
    z_pre = pre[0]
    got_sum = zp.sum(-1).transpose(1, 2)[real]
    assert float((got_sum.double() - z_pre[..., heads][real].double()).abs().max()) \
        <= 1e-5 * float(z_pre.abs().max())


_ZP = dict(family=st.sampled_from(["llama", "qwen3", "neox", "gemma2", "olmo2", "phi3", "gemma"]),
           b=st.integers(1, 3),
       s=st.integers(1, 9), offset=st.integers(0, 20), pad=st.integers(0, 4), bf16=st.booleans(),
       seed=st.integers(0, 2**16))


def _zp_case(family, b, s, offset, pad, bf16, seed):
    """RoPE / QK-norm families, position offsets, key padding, fp32 and bf16: the z-pattern's contributions summed
    over keys == the Lorsa's own ``z_pre`` (SDPA path), and ``z`` wherever the head is active; patterns are
    distributions over the allowed keys."""
    _zp_check(family, b, s, offset, pad, bf16, seed)


@torch.no_grad()
def _zp_check(family, b, s, offset, pad, bf16, seed):
    dtype = torch.bfloat16 if bf16 else torch.float32
    lorsa = _setup(family)[3]
    lorsa = lorsa.to(dtype) if bf16 else lorsa
    g = torch.Generator().manual_seed(seed)
    try:
        x = torch.randn(b, s, lorsa.cfg.d_model, generator=g).to(dtype)
        positions = torch.arange(offset, offset + s)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, :min(pad, s - 1)] = 0
        heads = torch.randperm(lorsa.cfg.n_ov_heads, generator=g)[:5]
        zp = lorsa.z_pattern(x, heads, positions, mask)
        a = lorsa.attention_pattern(x, None, positions, mask).float()
        z_pre = lorsa.compute_z_pre(x, positions, mask)
        z, _ = lorsa.activation(z_pre)
    finally:
        lorsa.float()
    real = mask.bool()
    tol = 2e-2 if bf16 else 1e-5
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None] & real[:, None, :]
    banned = (~allowed & real[:, :, None])[:, None]  # a real query's masked keys (a padding query: itself)
    assert float(a.masked_select(banned).abs().max() if banned.any() else 0) == 0
    rows = a.sum(-1).transpose(1, 2)[real]
    assert float((rows - 1).abs().max()) <= tol
    got = zp.float().sum(-1).transpose(1, 2)  # (b, s, heads)
    want = z_pre[..., heads].float()
    scale = max(float(want.abs().max()), 1e-6)
    assert float((got - want)[real].abs().max()) <= tol * scale
    zh = z[..., heads].float()
    on = (zh > 0) & real[..., None]
    assert float((got - zh)[on].abs().max() if on.any() else 0) <= tol * scale


test_z_pattern_sums_to_z_pre = _generated(_zp_case, _ZP, 10)
test_sweep_z_pattern_sums_to_z_pre = pytest.mark.slow(_generated(_zp_case, _ZP, 1000))


# ----------------------------------------------------------- MHSA correlation
@torch.no_grad()
def _per_head_outputs(hf, adapter, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """Each MHSA head's output ``(b, s, H, d)`` without ``b_O``, from the output projection's input (a forward
    pre-hook: the heads' concatenated ``A v``) times the projection's columns of that head."""
    attn = adapter.attention_module(hf, layer)
    proj = next(m for n, m in attn.named_children() if n in ("o_proj", "c_proj", "dense"))
    seen: list = []
    handle = proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    try:
        hf(ids)
    finally:
        handle.remove()
    zc = seen[0]  # (b, s, H * e)
    w = proj.weight if type(proj).__name__ != "Conv1D" else proj.weight.T  # (d, H * e)
    n_heads = adapter.n_heads
    e = zc.shape[-1] // n_heads
    return torch.einsum("bshe,dhe->bshd", zc.unflatten(-1, (n_heads, e)).double(),
                        w.double().unflatten(1, (n_heads, e)))


def _correlation_reference(family: str, layer: int, ids: torch.Tensor, skip_first: bool):
    """App. E.1 by hand: ``(mean coefficients (n_ov, H) fp64, active counts (n_ov,))``."""
    _, hf, adapter, lorsa, _ = _setup(family, layer)
    o = _per_head_outputs(hf, adapter, layer, ids)
    store: list = []
    with torch.no_grad(), _capture_z(hf, adapter, layer, lorsa, store):
        hf(ids)
    z = store[0].double()
    n_ov, n_heads = lorsa.cfg.n_ov_heads, adapter.n_heads
    contrib = torch.zeros(n_ov, n_heads, dtype=torch.float64)
    count = torch.zeros(n_ov, dtype=torch.long)
    w_o = lorsa.W_O.detach().double()
    for b in range(ids.shape[0]):
        for s in range(1 if skip_first else 0, ids.shape[1]):
            act = (z[b, s] > 0).nonzero().flatten()
            if act.numel() == 0:
                continue
            basis = (z[b, s, act][:, None] * w_o[act]).T  # (d, k)
            coef = torch.linalg.lstsq(basis, o[b, s].T, driver="gelsd").solution  # (k, H)
            contrib[act] += coef
            count[act] += 1
    return contrib / count.clamp_min(1)[:, None], count


@pytest.mark.parametrize(("family", "layer"), [("llama", LAYER), ("gpt2", LAYER), ("gemma2", 0), ("qwen3", LAYER),
                                               ("neox", LAYER), ("olmo2", LAYER), ("phi3", LAYER), ("gemma3", 0),
                                               ("mistral", LAYER), ("gemma", LAYER), ("qwen2", LAYER)])
def test_mhsa_correlation_against_per_token_least_squares(family, layer):
    """App. E.1 by hand: at every non-BOS token, least squares (fp64) of each MHSA head's output (read by a hook
    on the output projection) on the active Lorsa heads' ``z_h w_o^h`` (``z`` from the plain-hook splice);
    mean per Lorsa head over its active tokens. Gemma-2 layer 0: sliding window 4 and soft-capped scores."""
    _, _, _, _, rm = _setup(family, layer)
    ids = _ids(3, 9, 5)
    want, count = _correlation_reference(family, layer, ids, True)
    corr = mhsa_correlation(rm, layer, ids, batch_size=2)
    assert corr.n_tokens == 3 * 8
    assert torch.equal(corr.count, count)
    rel = float((corr.contrib.double() - want).abs().max() / want.abs().max())
    assert rel <= 1e-5, rel  # measured 4e-8 – 7e-8 over the 11 families


_CORR = dict(family=st.sampled_from([("llama", LAYER), ("gemma2", 0), ("gpt2", LAYER), ("olmo2", LAYER),
                                     ("phi3", LAYER), ("gemma", LAYER)]),
             n=st.integers(1, 4), pos=st.integers(2, 9), batch_size=st.integers(1, 4), skip_first=st.booleans(),
             seed=st.integers(0, 2**16))


def _correlation_case(family, n, pos, batch_size, skip_first, seed):
    """``mhsa_correlation`` over drawn windows, batch sizes and ``skip_first`` == the hand App. E.1; its
    ``heads_spanned`` == the fewest largest normalised contributions whose sum reaches 90% (0 for inactive heads, -1
    for heads whose contributions sum to 0 or less)."""
    fam, layer = family
    rm = _setup(fam, layer)[4]
    ids = _ids(n, pos, seed)
    want, count = _correlation_reference(fam, layer, ids, skip_first)
    corr = mhsa_correlation(rm, layer, ids, batch_size=batch_size, skip_first=skip_first)
    assert corr.n_tokens == n * (pos - 1 if skip_first else pos) and torch.equal(corr.count, count)
    scale = max(float(want.abs().max()), 1e-12)
    assert float((corr.contrib.double() - want).abs().max()) <= 1e-5 * scale
    spanned = corr.heads_spanned().tolist()
    for h in range(want.shape[0]):
        if count[h] == 0:
            assert spanned[h] == 0
            continue
        if float(corr.contrib[h].double().sum()) <= 0:  # no normalisation: undefined (it was a nonsense count)
            assert spanned[h] == -1 and corr.fractions()[h].isnan().all()
            continue
        frac = (corr.contrib[h] / corr.contrib[h].sum()).sort(descending=True).values.cumsum(0)
        if bool(((frac - 0.9).abs() > 1e-6).all()) and float(frac[-1]) >= 0.9:  # no sum on the bar
            assert spanned[h] == int((frac >= 0.9).nonzero()[0]) + 1, (h, frac, spanned[h])


test_mhsa_correlation_generated = _generated(_correlation_case, _CORR, 6)
test_sweep_mhsa_correlation_generated = pytest.mark.slow(_generated(_correlation_case, _CORR, 200))


# ------------------------------------------------------------------ logit lens
@pytest.mark.parametrize("family", ["gpt2", "neox", "qwen3", "olmo2", "gemma", "gemma3", "phi3"])
def test_ov_logit_lens_against_the_weights(family):
    """``W_U (g ⊙ P w_o)`` written per family from the HF modules: the final norm's gain (``1 + w`` for Gemma), the
    post-attention norm's gain before it where the attention output is normed before the residual (OLMo-2,
    Gemma-3); ``P`` a LayerNorm's centring (GPT-2, NeoX: ``w − mean w``; identity for an RMSNorm); a LayerNorm's bias
    left out."""
    _, hf, adapter, lorsa, rm = _setup(family)
    base = hf.base_model
    final = next(getattr(base, n) for n in ("norm", "final_layer_norm", "ln_f") if hasattr(base, n))
    gain = final.weight.detach().double() + (1.0 if family.startswith("gemma") else 0.0)
    layer_mod = adapter.attention_module(hf, LAYER)
    block = next(m for m in hf.modules() if any(c is layer_mod for c in m.children()))
    if family in ("olmo2", "gemma3"):
        post = block.post_attention_layernorm.weight.detach().double()
        gain = gain * (post + (1.0 if family == "gemma3" else 0.0))
    w_u = hf.get_output_embeddings().weight.detach().double()
    heads = [0, 9, lorsa.cfg.n_ov_heads - 1]
    w_o = lorsa.W_O.detach().double()[heads]
    if isinstance(final, torch.nn.LayerNorm):
        w_o = w_o - w_o.mean(-1, keepdim=True)
    want = ((w_o * gain) @ w_u.T).topk(6, -1)
    vals, ids, _ = ov_logit_lens(rm, LAYER, heads, k=6)
    assert float((vals.double() - want.values).abs().max()) <= 1e-5 * float(want.values.abs().max())
    assert torch.equal(ids, want.indices)


# ------------------------------------------------------------------ dashboard
@torch.no_grad()
def test_dashboard_contributions_sum_to_z():
    """``head_dashboard_data``'s per-token contributions (the z-pattern row of the query, from the window start) sum
    to the context's listed ``z`` and equal the hand pattern × value (GPT-2, fp64 reference)."""
    from nnsight_lorsa.viz import head_dashboard_data

    model, hf, adapter, lorsa, rm = _setup("gpt2")
    ids = _ids(4, 12, 21)
    z = _reference_z("gpt2", ids)
    top = collect_top_activations(rm, LAYER, ids, n_top=3, batch_size=3)
    head = int(top.top_heads(1)[0])
    data = head_dashboard_data(rm, LAYER, head, top, ids, window=40)
    assert data["contexts"]
    x = _attention_input(hf, adapter, ids)
    a = _hand_pattern(lorsa, x, None)[:, head // lorsa.cfg.group_size]
    v = x.double() @ lorsa.W_V[head].double() + float(lorsa.b_V[head])
    for ctx in data["contexts"]:
        w, p = ctx["window"], ctx["position"]
        assert abs(ctx["z"] - float(z[w, p, head])) <= 1e-4 + 1e-5 * abs(ctx["z"])
        contrib = torch.tensor(ctx["contrib"], dtype=torch.float64)
        assert contrib.numel() == p + 1 == len(ctx["tokens"])
        want = a[w, p, :p + 1] * v[w, :p + 1]
        assert float((contrib - want).abs().max()) <= 1e-4  # rounded to 4 decimals
        assert abs(float(contrib.sum()) - float(z[w, p, head])) <= 1e-4 * (p + 1) + 1e-5 * abs(ctx["z"])


# ------------------------------------------- circuit size, component scores, head swap (by hand with hooks)
@contextlib.contextmanager
def _hand_edits(hf, adapter, lorsa, error: bool, z_edit=None, mhsa_edit=None):
    """The Lorsa spliced at ``LAYER`` (``error``: the MHSA output plus ``(z_edited − z) W_O``, i.e. the Lorsa output
    edited plus the unedited error term; else the Lorsa's output) with ``z_edit(z) -> z'``, and ``mhsa_edit(layer,
    heads_concat) -> heads_concat`` on every layer's output-projection input; plain forward hooks."""
    handles = []
    sliding = adapter.sliding_window(LAYER) is not None  # Phi-3 (window on every layer): a Lorsa is global (unpadded)

    def lorsa_hook(module, args, kwargs, output):
        x = adapter.attention_input(args, kwargs)
        z_pre = lorsa.compute_z_pre(x, adapter.attention_positions(args, kwargs, x),
                                    None if sliding else adapter.attention_mask(args, kwargs))
        z, _ = lorsa.activation(z_pre)
        ze = z if z_edit is None else z_edit(z.clone())
        out = lorsa.decode(ze)
        if error:
            y = output[0] if isinstance(output, tuple) else output
            out = out + (y - lorsa.decode(z))
        return adapter.with_attention_output(output, out)
    handles.append(adapter.attention_module(hf, LAYER).register_forward_hook(lorsa_hook, with_kwargs=True))
    if mhsa_edit is not None:
        for layer in range(hf.config.num_hidden_layers):
            attn = adapter.attention_module(hf, layer)
            proj = next(m for n, m in attn.named_children() if n in ("o_proj", "c_proj", "dense"))
            handles.append(proj.register_forward_pre_hook(
                lambda m, a, layer=layer: (mhsa_edit(layer, a[0].clone()),) + tuple(a[1:])))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _lm_logits(hf, ids) -> torch.Tensor:
    seen: list = []
    h = hf.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        hf(ids)
    finally:
        h.remove()
    return seen[0].double()


_CIRCUIT = dict(family=st.sampled_from(["llama", "gpt2", "olmo2", "phi3", "gemma"]), error=st.booleans(),
                b=st.integers(1, 3),
                seed=st.integers(0, 2**16))


def _circuit_case(family, error, b, seed):
    """``component_scores(method="ablation")`` and ``circuit_size``'s curves, per-prompt and global k against the
    same keep-top-k runs done with hooks: Lorsa heads mean-ablated in ``z`` (a drawn scalar) and MHSA heads (of
    another layer) in the output projection's input (a drawn vector), the metric the logit difference at the last
    position."""
    from nnsight_lorsa.envoy.targets import LorsaHead, MHSAHead
    from nnsight_lorsa.patching.circuit import circuit_size, component_scores
    from nnsight_lorsa.patching.tasks import TaskBatch

    model, hf, adapter, lorsa, _ = _setup(family)
    rmod = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}), error=error)
    g = torch.Generator().manual_seed(seed)
    ids = _ids(b, 7, seed)
    correct = torch.randint(2, VOCAB, (b,), generator=g)
    incorrect = 2 + (correct - 2 + torch.randint(1, VOCAB - 2, (b,), generator=g)) % (VOCAB - 2)  # != correct
    task = TaskBatch("probe", ids, ids.clone(), correct, incorrect)
    z0 = _reference_z(family, ids)
    active = (z0 > 0).any(0).any(0).nonzero().flatten()[:4].tolist()
    d = adapter.head_dim
    comps = [*(LorsaHead(LAYER, h) for h in active), MHSAHead(0, 0), MHSAHead(0, 1)]
    means = {c: torch.randn(d if isinstance(c, MHSAHead) else (), generator=g) for c in comps}
    n = len(comps)

    def metric_of(keep: torch.Tensor) -> torch.Tensor:  # keep (b, n) bool -> (b,) logit difference, by hand
        def z_edit(z):
            for i, c in enumerate(comps):
                if isinstance(c, LorsaHead):
                    k = keep[:, i, None].to(z.dtype)
                    z[:, :, c.head] = z[:, :, c.head] * k + (1 - k) * means[c].to(z.dtype)
            return z

        def mhsa_edit(layer, t):
            for i, c in enumerate(comps):
                if isinstance(c, MHSAHead) and c.layer == layer:
                    k = keep[:, i, None, None].to(t.dtype)
                    cols = slice(c.head * d, (c.head + 1) * d)
                    t[:, :, cols] = t[:, :, cols] * k + (1 - k) * means[c].to(t.dtype)
            return t
        with torch.no_grad(), _hand_edits(hf, adapter, lorsa, error, z_edit, mhsa_edit):
            lg = _lm_logits(hf, ids)[:, -1]
        return lg.gather(1, correct[:, None])[:, 0] - lg.gather(1, incorrect[:, None])[:, 0]

    full = torch.ones(b, n, dtype=torch.bool)
    m_all = metric_of(full)
    want_scores = torch.stack([m_all - metric_of(full.clone().index_fill_(1, torch.tensor([i]), False))
                               for i in range(n)], 1)
    got_scores = component_scores(rmod, task, comps, mode="mean", means=means)
    scale = float(m_all.abs().max()) + 1.0
    assert float((got_scores.double() - want_scores).abs().max()) <= 1e-4 * scale, (got_scores, want_scores)
    scores = torch.randn(b, n, generator=g)  # continuous: no ranking ties
    res = circuit_size(rmod, task, comps, scores=scores, mode="mean", means=means)
    ks = res.ks.tolist()
    assert ks == list(range(n + 1))
    mp = torch.stack([metric_of(torch.zeros(b, n, dtype=torch.bool).scatter_(
        1, scores.argsort(1, descending=True)[:, :k], True)) for k in ks])  # (K, b)
    order = scores.mean(0).argsort(descending=True)
    mg = torch.stack([metric_of(torch.zeros(b, n, dtype=torch.bool).index_fill_(1, order[:k], True))
                      if k else metric_of(torch.zeros(b, n, dtype=torch.bool)) for k in ks])
    per = (mp - mp[0]) / (mp[-1] - mp[0])
    glob = (mg.mean(1) - mg[0].mean()) / (mg[-1].mean() - mg[0].mean())
    torch.testing.assert_close(res.metric_all.double(), mp[-1], atol=1e-4 * scale, rtol=0)
    torch.testing.assert_close(res.metric_none.double(), mp[0], atol=1e-4 * scale, rtol=0)
    torch.testing.assert_close(res.global_curve.double(), glob, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(res.per_prompt_curve.double(), per, atol=1e-3, rtol=1e-3)
    far = lambda f: bool(((f - 0.9).abs() > 1e-3).all())  # noqa: E731 (k only where no fraction sits on the bar)
    if far(glob):
        want_gk = next((k for k, f in zip(ks, glob.tolist(), strict=True) if f >= 0.9), n)
        assert res.global_k == want_gk
    for r in range(b):
        if far(per[:, r]):
            assert int(res.per_prompt_k[r]) == next((k for k, f in zip(ks, per[:, r].tolist(), strict=True)
                                                     if f >= 0.9), n)


test_circuit_size_and_component_scores_by_hand = _generated(_circuit_case, _CIRCUIT, 4)
test_sweep_circuit_size_and_component_scores_by_hand = pytest.mark.slow(_generated(_circuit_case, _CIRCUIT, 150))


_SWAP = dict(family=st.sampled_from(["llama", "gpt2", "gemma2", "qwen3", "neox", "olmo2", "phi3", "gemma"]),
             error=st.booleans(),
       swap=st.booleans(), pos=st.sampled_from([-1, 3, [1, 4], None]), b=st.integers(1, 3), seed=st.integers(0, 2**16))


def _swap_case(family, error, swap, pos, b, seed):
    """``head_swap``: ``from_head``'s z moved to (or exchanged with) ``to_head`` at ``positions`` = the same edit of
    ``z`` by a hook; the baseline = the unedited splice (Gemma-2: logits soft-capped as ``saved_logits`` states)."""
    from nnsight_lorsa.patching.experiments import head_swap

    model, hf, adapter, lorsa, _ = _setup(family)
    rmod = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}), error=error)
    ids = _ids(b, 6, seed)
    z0 = _reference_z(family, ids)
    act = (z0 > 0).any(0).any(0).nonzero().flatten().tolist()
    g = torch.Generator().manual_seed(seed)
    f, t = (act[int(i)] for i in torch.randperm(len(act), generator=g)[:2]) if len(act) > 1 else (0, 1)
    p = slice(None) if pos is None else pos

    def z_edit(z):
        zf, zt = z[:, p, f].clone(), z[:, p, t].clone()
        z[:, p, f] = zt if swap else 0
        z[:, p, t] = zf
        return z
    cap = adapter.final_logit_softcap()

    def capped(lg):
        return lg if cap is None else cap * torch.tanh(lg / cap)
    with torch.no_grad():
        with _hand_edits(hf, adapter, lorsa, error):
            want_base = capped(_lm_logits(hf, ids))
        with _hand_edits(hf, adapter, lorsa, error, z_edit):
            want = capped(_lm_logits(hf, ids))
    base, got = head_swap(rmod, LAYER, f, t, ids, positions=pos, swap=swap)
    scale = float(want_base.abs().max())
    assert float((base.double() - want_base).abs().max()) <= 1e-5 * scale
    assert float((got.double() - want).abs().max()) <= 1e-5 * scale



test_head_swap_by_hand = _generated(_swap_case, _SWAP, 8)
test_sweep_head_swap_by_hand = pytest.mark.slow(_generated(_swap_case, _SWAP, 400))


@torch.no_grad()
def test_top_activations_of_an_fp32_lorsa_on_a_bf16_model():
    """A bf16 model with an fp32 Lorsa (the Lorsa sees the attention input in its own dtype): the table == the top
    of the fp32 Lorsa's ``z`` on the bf16 input captured by a hook, to a few units of fp32 rounding (the table's
    batches of 2 and the reference's batch of 3 round differently on an AVX-512 CPU); counts equal."""
    for family in ("llama", "gemma2"):
        model, hf = tiny_nnsight(family, dtype=torch.bfloat16)
        adapter = get_adapter(model)
        lorsa = make_lorsa(hf.float(), adapter)
        hf.to(torch.bfloat16)
        rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
        ids = _ids(3, 9, 2)
        x = _attention_input(hf, adapter, ids)
        assert x.dtype == torch.bfloat16
        z = lorsa(x.float(), return_cache=True)[1].z
        tol = 8 * torch.finfo(torch.float32).eps * float(z.abs().max())
        for distinct in (False, True):
            top = collect_top_activations(rm, LAYER, ids, n_top=3, batch_size=2, distinct_windows=distinct)
            _check_top(top, z, 3, 1, distinct, tol)


# ------------------------------------------------------------- QK feature ablation (App. F.1), by hand
def qk_kl_reference(prompts, lorsa, head: int, decoder: torch.Tensor):
    """App. F.1 written out in fp64 on GPT-2 (no RoPE / QK-norm: ``q = x W_Q^g + b_Q^g``), over ``prompts``: each
    ``(x, a, z)`` of one prompt alone — the attention input ``(s, d_model)``, the SAE's activations ``(s, n_f)`` (both
    fp64) and the head's ``z`` ``(s,)``. At every activation ``z_i > 0`` (BOS skipped), Q: the query from
    ``x_i − a_f(x_i) d_f``; K: every key ``j ≤ i`` from ``x_j − a_f(x_j) d_f``; ``KL(A_i ‖ A'_i)``; per feature the
    max and how many activations it was present at. Returns ``(q_kl, k_kl, q_count, k_count, n_activations)``."""
    g = head // lorsa.cfg.group_size
    wq, bq, wk, bk = (t.detach().double() for t in (lorsa.W_Q[g], lorsa.b_Q[g], lorsa.W_K[g], lorsa.b_K[g]))
    d = decoder.detach().double()
    n_f = d.shape[0]
    q_kl, k_kl = torch.zeros(n_f, dtype=torch.float64), torch.zeros(n_f, dtype=torch.float64)
    q_cnt, k_cnt = torch.zeros(n_f, dtype=torch.long), torch.zeros(n_f, dtype=torch.long)
    n_act = 0
    for x, a, z in prompts:
        for i in range(1, x.shape[0]):
            if z[i] <= 0:
                continue
            n_act += 1
            k0, q0 = x[:i + 1] @ wk + bk, x[i] @ wq + bq
            row = (q0 @ k0.T / lorsa.cfg.scale).softmax(-1)

            def kl(q, k, row=row):  # KL of the original row vs one from (q, k), both over keys 0..i
                return float((row * (row.log() - (q @ k.T / lorsa.cfg.scale).log_softmax(-1))).sum())
            for f in range(n_f):
                if a[i, f] != 0:
                    q_cnt[f] += 1
                    q_kl[f] = max(q_kl[f], kl((x[i] - a[i, f] * d[f]) @ wq + bq, k0))
                if (a[:i + 1, f] != 0).any():
                    k_cnt[f] += 1
                    k_kl[f] = max(k_kl[f], kl(q0, (x[:i + 1] - a[:i + 1, f, None] * d[f]) @ wk + bk))
    return q_kl, k_kl, q_cnt, k_cnt, n_act


@torch.no_grad()
def test_qk_feature_impacts_by_hand_on_gpt2():
    """:func:`qk_kl_reference` on three GPT-2 prompts == ``qk_feature_impacts`` on their batch (per feature the max
    KL, where, and how many activations it was present at)."""
    from helpers import make_sae

    from nnsight_lorsa.analysis import qk_feature_impacts

    _, hf, adapter, lorsa, rm = _setup("gpt2")
    sae = make_sae(seed=3, d_in=lorsa.cfg.d_model, d_sae=48, activation="topk", activation_params={"k": 6})
    ids = _ids(3, 8, 31)
    x_model = _attention_input(hf, adapter, ids)
    z = _reference_z("gpt2", ids)
    head = int((z[:, 1:] > 0).sum((0, 1)).argmax())
    q_kl, k_kl, q_cnt, k_cnt, n_act = qk_kl_reference(
        [(x_model[b].double(), sae.encode(x_model[b]).double(), z[b, :, head]) for b in range(ids.shape[0])],
        lorsa, head, sae.W_dec)
    res = qk_feature_impacts(rm, LAYER, head, sae, ids, batch_size=2)
    assert res.n_activations == n_act > 0 and res.n_tokens == 3 * 7
    assert torch.equal(res.q_count, q_cnt) and torch.equal(res.k_count, k_cnt)
    scale = float(torch.cat([q_kl, k_kl]).max())
    assert scale > 0
    assert float((res.q_kl.double() - q_kl).abs().max()) <= 1e-5 * scale + 1e-7
    assert float((res.k_kl.double() - k_kl).abs().max()) <= 1e-5 * scale + 1e-7


@pytest.mark.parametrize(("family", "layer"), [("gemma2", 0), ("mistral", LAYER), ("gemma3", 0), ("phi3", LAYER)])
@torch.no_grad()
def test_top_activations_on_a_sliding_window_layer(family, layer):
    """A Lorsa on a sliding-window layer (window 4, windows of 10 tokens) is global: the table == the top of the
    ``z`` the plain-hook splice computes with the causal mask alone."""
    _, hf, adapter, lorsa, rm = _setup(family, layer)
    assert adapter.sliding_window(layer) == 4
    ids = _ids(3, 10, 4)
    store: list = []
    with _capture_z(hf, adapter, layer, lorsa, store):
        hf(ids)
    z = store[0].float()
    for distinct in (False, True):
        top = collect_top_activations(rm, layer, ids, n_top=4, batch_size=2, distinct_windows=distinct)
        _check_top(top, z, 4, 1, distinct, 1e-5 * float(z.abs().max()))
