"""Probe of the analysis functions on padded batches, edited models, half precision and degenerate inputs, against
references written here in plain PyTorch (forward hooks on the Hugging Face model, no nnsight, not the code under
test) and against each prompt alone. docs/reliability.md, "Analysis on padded batches and edited models probe
(2026-11-28)".

* padding: ``collect_top_activations``, ``mhsa_correlation`` and ``qk_feature_impacts`` with ``attention_mask=``
  (left and right padding, rows of padding only): padded positions enter no statistic, entry, count, KL or
  ``n_tokens``; a prompt's numbers are those of the prompt alone (by hand; and the function alone, relative bound);
* a model carrying an edit stored by ``model.edit()``: the top activations / QK impacts are those of the edited
  model's attention input (a hook doing the same edit), ``mhsa_correlation`` refuses; inside a trace body every
  function is a ``TraceOrderError``;
* bf16 / fp16 models: against fp64 references from the same activations; an fp16 overflow is a named error;
* one token, a feature that never fires, ``n_top`` above the tokens, a mask with holes / of the wrong shape.
"""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, VOCAB, hooked, make_lorsa, make_sae, tiny_nnsight
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_probe_analysis_numbers import _attention_input, qk_kl_reference

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis import collect_top_activations, mhsa_correlation, qk_feature_impacts
from nnsight_lorsa.errors import ArgumentError, NonFiniteError, ShapeError, TraceOrderError

_MODELS: dict = {}


def _generated(body, strategies: dict, n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(**strategies)(body))


def _setup(family: str = "llama", dtype: torch.dtype = torch.float32):
    key = (family, dtype)
    if key not in _MODELS:
        model, hf = tiny_nnsight(family, dtype=dtype)
        adapter = get_adapter(model)
        lorsa = make_lorsa(hf, adapter).to(dtype)
        _MODELS[key] = (model, hf, adapter, lorsa, ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa})))
    return _MODELS[key]


def _prompts(lens: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(2, VOCAB, (n,), generator=g) for n in lens]
    for p in out:
        if len(p):
            p[0] = 0  # BOS
    return out


def _pad(prompts: list[torch.Tensor], sides: list[str], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``(ids, mask, offsets)``: the prompts padded (pad id 1) to the longest + ``extra`` on each row's side;
    ``offsets[r]`` is the column of row ``r``'s first token (a prompt of length 0: a row of padding only)."""
    width = max(len(p) for p in prompts) + extra
    ids = torch.ones(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    offsets = []
    for r, (p, side) in enumerate(zip(prompts, sides, strict=True)):
        o = width - len(p) if side == "left" else 0
        ids[r, o:o + len(p)] = p
        mask[r, o:o + len(p)] = 1
        offsets.append(o)
    return ids, mask, offsets


@torch.no_grad()
def _z_alone(hf, adapter, lorsa, prompt: torch.Tensor) -> torch.Tensor:
    """The Lorsa's ``z`` ``(pos, n_ov)`` on the prompt alone, by the plain-hook splice (fp32)."""
    store: list = []

    def keep(z):
        store.append(z.detach().clone())
        return z
    with hooked(hf, adapter, {LAYER: lorsa}, edit=keep):
        hf(prompt[None])
    return store[0][0].float()



@torch.no_grad()
def _per_head_alone(hf, adapter, prompt: torch.Tensor) -> torch.Tensor:
    """Each MHSA head's output ``(pos, H, d)`` fp64 without ``b_O`` on the prompt alone: the output projection's
    input (a pre-hook) times that head's columns."""
    attn = adapter.attention_module(hf, LAYER)
    proj = next(m for n, m in attn.named_children() if n in ("o_proj", "c_proj", "dense"))
    seen: list = []
    handle = proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    try:
        hf(prompt[None])
    finally:
        handle.remove()
    w = proj.weight if type(proj).__name__ != "Conv1D" else proj.weight.T  # (d, H * e)
    n_heads = adapter.n_heads
    e = seen[0].shape[-1] // n_heads
    return torch.einsum("she,dhe->shd", seen[0][0].unflatten(-1, (n_heads, e)).double(),
                        w.double().unflatten(1, (n_heads, e)))


def _correlation_by_hand(hf, adapter, lorsa, prompts, skip_first: bool = True):
    """App. E.1 over the prompts, each alone: (sum of coefficients (n_ov, H) fp64, counts, tokens)."""
    n_ov, n_heads = lorsa.cfg.n_ov_heads, adapter.n_heads
    total = torch.zeros(n_ov, n_heads, dtype=torch.float64)
    count = torch.zeros(n_ov, dtype=torch.long)
    n_tokens = 0
    w_o = lorsa.W_O.detach().double()
    for p in prompts:
        if len(p) == 0:
            continue
        o, z = _per_head_alone(hf, adapter, p), _z_alone(hf, adapter, lorsa, p).double()
        for s in range(1 if skip_first else 0, len(p)):
            n_tokens += 1
            act = (z[s] > 0).nonzero().flatten()
            if act.numel() == 0:
                continue
            coef = torch.linalg.lstsq((z[s, act][:, None] * w_o[act]).T, o[s].T, driver="gelsd").solution
            total[act] += coef
            count[act] += 1
    return total, count, n_tokens


# ------------------------------------------------------------------------------------------------- padding
_PAD = dict(lens=st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda v: max(v) >= 2),
            sides=st.lists(st.sampled_from(["left", "right"]), min_size=4, max_size=4),
            extra=st.integers(0, 2), batch_size=st.integers(1, 4), skip=st.integers(0, 3), n_top=st.integers(1, 12),
            distinct=st.booleans(), family=st.sampled_from(["llama", "gpt2", "qwen3", "neox", "gemma2"]),
            seed=st.integers(0, 2**16))


def _top_padded_case(lens, sides, extra, batch_size, skip, n_top, distinct, family, seed):
    """``collect_top_activations`` on a padded batch == the definition on each prompt alone (plain-hook ``z``):
    counts and ``n_tokens`` over the tokens from each prompt's ``skip``-th on, the entries the top of those
    (every entry at a token of its row, holding the prompt-alone value), empty slots ``-inf`` / ``-1``."""
    _, hf, adapter, lorsa, rm = _setup(family)
    prompts = _prompts(lens, seed)
    ids, mask, offsets = _pad(prompts, sides[:len(lens)], extra)
    skip = min(skip, ids.shape[1] - 1)
    top = collect_top_activations(rm, LAYER, ids, n_top=n_top, batch_size=batch_size, skip_start=skip,
                                  distinct_windows=distinct, attention_mask=mask)
    n_ov = lorsa.cfg.n_ov_heads
    zs = [_z_alone(hf, adapter, lorsa, p)[skip:] if len(p) > skip else torch.zeros(0, n_ov) for p in prompts]
    assert top.n_tokens == sum(z.shape[0] for z in zs)
    assert torch.equal(top.count, sum(((z > 0).sum(0) for z in zs), torch.zeros(n_ov, dtype=torch.long)))
    scale = max([float(z.abs().max()) for z in zs if z.numel()] + [1e-30])
    tol = 1e-5 * scale
    for h in range(n_ov):
        cand = [float(z[:, h].max()) for z in zs if z.numel()] if distinct else \
            [float(v) for z in zs for v in z[:, h]]
        want = sorted(cand, reverse=True)[:n_top]
        m = len(want)
        got_v = top.values[h].tolist()
        assert got_v[:m] == pytest.approx(want, abs=tol), (h, got_v, want)
        assert all(v == float("-inf") for v in got_v[m:])
        assert bool((top.window[h, m:] == -1).all()) and bool((top.position[h, m:] == -1).all())
        for w, c, v in zip(top.window[h, :m].tolist(), top.position[h, :m].tolist(), got_v[:m], strict=True):
            assert bool(mask[w, c]), f"head {h}: an entry at padding ({w}, {c})"
            i = c - offsets[w]  # the prompt's own position
            assert skip <= i < len(prompts[w]), (h, w, c, i)
            assert abs(float(zs[w][i - skip, h]) - v) <= tol, (h, w, c, v)


test_top_activations_of_a_padded_batch = _generated(_top_padded_case, _PAD, 4)
test_sweep_top_activations_of_a_padded_batch = pytest.mark.slow(_generated(_top_padded_case, _PAD, 300))


def _correlation_padded_case(lens, sides, extra, batch_size, skip, n_top, distinct, family, seed):
    """``mhsa_correlation`` on a padded batch == App. E.1 by hand over each prompt alone (least squares of the
    MHSA heads' outputs read by a hook; ``skip_first`` skips each prompt's first token)."""
    del n_top, distinct
    _, hf, adapter, lorsa, rm = _setup(family)
    prompts = _prompts(lens, seed)
    ids, mask, _ = _pad(prompts, sides[:len(lens)], extra)
    skip_first = skip % 2 == 0
    total, count, n_tokens = _correlation_by_hand(hf, adapter, lorsa, prompts, skip_first)
    corr = mhsa_correlation(rm, LAYER, ids, batch_size=batch_size, skip_first=skip_first, attention_mask=mask)
    assert corr.n_tokens == n_tokens and torch.equal(corr.count, count)
    want = total / count.clamp_min(1)[:, None]
    scale = max(float(want.abs().max()), 1e-12)
    assert float((corr.contrib.double() - want).abs().max()) <= 1e-5 * scale


test_mhsa_correlation_of_a_padded_batch = _generated(_correlation_padded_case, _PAD, 4)
test_sweep_mhsa_correlation_of_a_padded_batch = pytest.mark.slow(_generated(_correlation_padded_case, _PAD, 150))


def _qk_padded_case(lens, sides, extra, batch_size, skip, n_top, distinct, family, seed):
    """``qk_feature_impacts`` on a padded batch == the same call on each prompt alone: max KL per feature (1e-5
    relative), counts of activations / presences, ``n_tokens``; the place of a maximum is a column of its row's
    prompt. A feature firing only at padding is present nowhere."""
    del n_top, distinct, skip
    _, _, _, lorsa, rm = _setup(family)
    prompts = [p for p in _prompts(lens, seed)]
    sae = make_sae(seed=seed % 7, d_in=lorsa.cfg.d_model, d_sae=32, activation="topk", activation_params={"k": 5})
    ids, mask, offsets = _pad(prompts, sides[:len(lens)], extra)
    alone = [qk_feature_impacts(rm, LAYER, head, sae, p[None]) for head in range(0, lorsa.cfg.n_ov_heads, 21)
             for p in prompts if len(p)]
    k = len([p for p in prompts if len(p)])
    for n, head in enumerate(range(0, lorsa.cfg.n_ov_heads, 21)):
        res = qk_feature_impacts(rm, LAYER, head, sae, ids, batch_size=batch_size, attention_mask=mask)
        parts = alone[n * k:(n + 1) * k]
        assert res.n_tokens == sum(a.n_tokens for a in parts)
        assert res.n_activations == sum(a.n_activations for a in parts)
        for side in ("q", "k"):
            want = torch.stack([getattr(a, f"{side}_kl") for a in parts]).max(0).values.double()
            cnt = sum(getattr(a, f"{side}_count") for a in parts)
            assert torch.equal(getattr(res, f"{side}_count"), cnt), (head, side)
            got = getattr(res, f"{side}_kl").double()
            assert float((got - want).abs().max()) <= 1e-5 * max(float(want.max()), 1e-6), (head, side)
            for w, c in zip(getattr(res, f"{side}_window").tolist(), getattr(res, f"{side}_position").tolist(),
                            strict=True):
                if w >= 0:
                    assert bool(mask[w, c]) and 1 <= c - offsets[w] < len(prompts[w]), (head, side, w, c)


test_qk_feature_impacts_of_a_padded_batch = _generated(_qk_padded_case, _PAD, 3)
test_sweep_qk_feature_impacts_of_a_padded_batch = pytest.mark.slow(_generated(_qk_padded_case, _PAD, 100))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_qk_feature_impacts_padded_by_hand_on_gpt2(dtype):
    """App. F.1 written out in fp64 (GPT-2: no RoPE) on each prompt alone == the call on the left- and right-padded
    batch; a feature active at the pads is not counted as present at a key (a pad is no key). bf16: the same
    half-precision activations and weights, the reference in fp64 (the call computes in fp32)."""
    _, hf, adapter, lorsa, rm = _setup("gpt2", dtype)
    sae = make_sae(seed=3, d_in=lorsa.cfg.d_model, d_sae=48, activation="topk", activation_params={"k": 6}).to(dtype)
    prompts = _prompts([4, 8, 6], 11)
    zs = [_z_alone(hf, adapter, lorsa, p) for p in prompts]
    head = int(sum((z[1:] > 0).sum(0) for z in zs).argmax())
    q_kl, k_kl, q_cnt, k_cnt, n_act = qk_kl_reference(
        [(x_model.double(), sae.encode(x_model).double(), z[:, head])  # the SAE encodes in its dtype, as the call's
         for x_model, z in ((_attention_input(hf, adapter, p[None])[0], z) for p, z in zip(prompts, zs, strict=True))],
        lorsa, head, sae.W_dec)
    assert n_act > 0
    for sides in (["left"] * 3, ["right"] * 3, ["left", "right", "left"]):
        ids, mask, _ = _pad(prompts, sides, extra=1)
        res = qk_feature_impacts(rm, LAYER, head, sae, ids, batch_size=2, attention_mask=mask)
        assert res.n_activations == n_act and res.n_tokens == sum(len(p) - 1 for p in prompts)
        assert torch.equal(res.q_count, q_cnt) and torch.equal(res.k_count, k_cnt), sides
        scale = float(torch.cat([q_kl, k_kl]).max())
        assert float((res.q_kl.double() - q_kl).abs().max()) <= 1e-5 * scale + 1e-7
        assert float((res.k_kl.double() - k_kl).abs().max()) <= 1e-5 * scale + 1e-7


def test_a_mask_that_is_not_left_or_right_padding_is_refused():
    """Holes, other values, floats, the wrong shape: named errors before the model runs, for the three functions."""
    *_, lorsa, rm = _setup()
    ids = torch.randint(2, VOCAB, (2, 6))
    sae = make_sae(d_in=lorsa.cfg.d_model, d_sae=16, activation="topk", activation_params={"k": 4})
    calls = [lambda m: collect_top_activations(rm, LAYER, ids, attention_mask=m),
             lambda m: mhsa_correlation(rm, LAYER, ids, attention_mask=m),
             lambda m: qk_feature_impacts(rm, LAYER, 0, sae, ids, attention_mask=m)]
    hole = torch.ones(2, 6, dtype=torch.long)
    hole[1, 2] = 0
    for call in calls:
        with pytest.raises(ArgumentError, match=r"rows \[1\] hold padding between tokens"):
            call(hole)
        with pytest.raises(ArgumentError, match="only 0"):
            call(torch.full((2, 6), 2))
        with pytest.raises(ArgumentError, match="float"):
            call(torch.ones(2, 6))
        with pytest.raises(ShapeError, match="tokens' shape"):
            call(torch.ones(2, 5, dtype=torch.long))


def test_tokens_that_are_not_ids_of_the_vocabulary_are_refused():
    """``qk_feature_impacts`` took float / bool tokens to torch's ``RuntimeError`` and an empty batch to an empty
    result; ids outside the vocabulary (or negative) were torch's ``IndexError`` from inside the trace in all three.
    Now ShapeError / ArgumentError before the model runs."""
    *_, lorsa, rm = _setup()
    sae = make_sae(d_in=lorsa.cfg.d_model, d_sae=16, activation="topk", activation_params={"k": 4})
    calls = [lambda t: collect_top_activations(rm, LAYER, t), lambda t: mhsa_correlation(rm, LAYER, t),
             lambda t: qk_feature_impacts(rm, LAYER, 0, sae, t)]
    for call in calls:
        for bad in (torch.rand(2, 5), torch.ones(2, 5, dtype=torch.bool), torch.zeros(0, 5, dtype=torch.long)):
            with pytest.raises(ShapeError, match="non-empty integer"):
                call(bad)
        for bad in (torch.full((2, 5), VOCAB), torch.full((2, 5), -1)):
            with pytest.raises(ArgumentError, match=rf"token ids in \[0, {VOCAB}\)"):
                call(bad)


# ------------------------------------------------------------------------------------------------ edited models
def test_inside_a_trace_body_the_analyses_are_a_trace_order_error():
    """They run traces of their own: inside a trace body nnsight ended in ``AttributeError: 'NoneType' object has
    no attribute 'event'``; now a TraceOrderError saying they cannot measure the traced pass."""
    model, _, _, lorsa, rm = _setup()
    ids = torch.randint(2, VOCAB, (2, 6))
    sae = make_sae(d_in=lorsa.cfg.d_model, d_sae=16, activation="topk", activation_params={"k": 4})
    for call in (lambda: collect_top_activations(rm, LAYER, ids), lambda: mhsa_correlation(rm, LAYER, ids),
                 lambda: qk_feature_impacts(rm, LAYER, 0, sae, ids)):
        with pytest.raises(TraceOrderError, match="inside a model.trace"), model.trace(ids):
            call()


@torch.no_grad()
def test_a_stored_edit_is_measured_by_top_activations_and_refused_by_the_recomputing_analyses():
    """``model.edit()`` halving layer 0's MLP output (upstream of the Lorsa's layer 1): ``collect_top_activations``
    measures the edited model (== a plain hook doing the same edit; != the unedited model); ``mhsa_correlation``,
    ``qk_feature_impacts`` and ``head_dashboard_data`` recompute the attention from weights, which a stored edit of
    the MHSA or of a stored Lorsa splice would not reach: ArgumentError (``mhsa_correlation`` and
    ``qk_feature_impacts`` returned numbers before, the latter ignoring a stored ablation of its head)."""
    from nnsight_lorsa.viz import head_dashboard_data

    model, hf, adapter, lorsa, rm = _setup()
    prompts = _prompts([7, 7, 7], 5)
    ids = torch.stack(prompts)
    handle = hf.model.layers[0].mlp.register_forward_hook(lambda m, a, o: o * 0.5)
    try:
        zs = torch.stack([_z_alone(hf, adapter, lorsa, p) for p in prompts])
    finally:
        handle.remove()
    unedited = torch.stack([_z_alone(hf, adapter, lorsa, p) for p in prompts])
    assert float((zs - unedited).abs().max()) > 1e-3, "the edit must move z"
    with model.edit(inplace=True):
        model.model.layers[0].mlp.output[:] = model.model.layers[0].mlp.output * 0.5
    sae = make_sae(d_in=lorsa.cfg.d_model, d_sae=16, activation="topk", activation_params={"k": 4})
    try:
        top = collect_top_activations(rm, LAYER, ids, n_top=2, distinct_windows=False)
        for call in (lambda: mhsa_correlation(rm, LAYER, ids), lambda: qk_feature_impacts(rm, LAYER, 0, sae, ids),
                     lambda: head_dashboard_data(rm, LAYER, 0, top, ids)):
            with pytest.raises(ArgumentError, match=r"stored by model\.edit\(\)"):
                call()
    finally:
        model.clear_edits()
    assert torch.equal(top.count, (zs[:, 1:] > 0).sum((0, 1)))
    want = zs[:, 1:].reshape(-1, zs.shape[-1]).topk(2, dim=0).values.T
    assert float((top.values - want).abs().max()) <= 1e-5 * float(zs.abs().max())


@torch.no_grad()
def test_stored_edits_downstream_and_a_stored_splice_of_the_lorsa():
    """A stored edit downstream of the Lorsa's layer (layer 2's MLP): the analyses' traces stopped after the layer and
    nnsight raised ``OutOfOrderError`` (also ``attention_activations``, what training's activation source reads
    through); now they run on and measure the unmodified layer. A stored splice of this Lorsa ablating head ``h``:
    ``collect_top_activations`` measures it (``h`` never active)."""
    from nnsight_lorsa.envoy.read import attention_activations

    model, hf, adapter, lorsa, rm = _setup()
    prompts = _prompts([7, 7], 9)
    ids = torch.stack(prompts)
    zs = torch.stack([_z_alone(hf, adapter, lorsa, p) for p in prompts])
    x = torch.stack([_attention_input(hf, adapter, p[None])[0] for p in prompts])
    with model.edit(inplace=True):
        model.model.layers[2].mlp.output[:] = 0
    try:
        top = collect_top_activations(rm, LAYER, ids, n_top=2, distinct_windows=False)
        act = attention_activations(model, LAYER, ids)
    finally:
        model.clear_edits()
    assert torch.equal(top.count, (zs[:, 1:] > 0).sum((0, 1)))
    assert float((act.x - x).abs().max()) <= 1e-6 * float(x.abs().max())
    h = int((zs[:, 1:] > 0).sum((0, 1)).argmax())
    with model.edit(inplace=True):
        rm.lorsas.replace(layer=LAYER, error=True).hook_z.output[..., h] = 0
    try:
        top = collect_top_activations(rm, LAYER, ids, n_top=2)
    finally:
        model.clear_edits()
    want = (zs[:, 1:] > 0).sum((0, 1))
    want[h] = 0
    assert torch.equal(top.count, want) and bool((top.values[h] == 0).all())


@torch.no_grad()
def test_the_bundles_other_replacements_are_not_spliced():
    """A ReplacementModel with a transcoder (error term off) at layer 0, upstream of the Lorsa: the analyses
    measure the model's own attention input — the top activations == the hooked ``z`` of the unmodified model,
    the correlation == App. E.1 by hand on it — as their docstrings say."""
    from helpers import make_transcoders

    from nnsight_lorsa import TranscoderSet

    model, hf, adapter, lorsa, _ = _setup()
    bundle = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}),
                              transcoders=TranscoderSet(model, make_transcoders([0])))
    prompts = _prompts([6, 6], 4)
    ids = torch.stack(prompts)
    zs = torch.stack([_z_alone(hf, adapter, lorsa, p) for p in prompts])
    top = collect_top_activations(bundle, LAYER, ids, n_top=2, distinct_windows=False)
    assert torch.equal(top.count, (zs[:, 1:] > 0).sum((0, 1)))
    want = zs[:, 1:].reshape(-1, zs.shape[-1]).topk(2, dim=0).values.T
    assert float((top.values - want).abs().max()) <= 1e-5 * float(zs.abs().max())
    total, count, _ = _correlation_by_hand(hf, adapter, lorsa, prompts)
    corr = mhsa_correlation(bundle, LAYER, ids)
    want_c = total / count.clamp_min(1)[:, None]
    assert torch.equal(corr.count, count)
    assert float((corr.contrib.double() - want_c).abs().max()) <= 1e-5 * float(want_c.abs().max())


# ------------------------------------------------------------------------------------------------ half precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_models_against_fp64(dtype):
    """bf16 / fp16 model and Lorsa, padded batch: the correlation == App. E.1 in fp64 from the same half-precision
    activations (the hooked model's ``z`` and MHSA head outputs; 2e-2 relative: the MHSA is recomputed in fp32 from
    the half-precision input where the model rounds it), the top activations == the hooked ``z`` (1e-2)."""
    _, hf, adapter, lorsa, rm = _setup("llama", dtype)
    prompts = _prompts([9, 6, 8], 2)
    ids, mask, _ = _pad(prompts, ["left", "right", "left"])
    total, count, n_tokens = _correlation_by_hand(hf, adapter, lorsa, prompts)
    corr = mhsa_correlation(rm, LAYER, ids, attention_mask=mask)
    assert corr.contrib.dtype == torch.float32 and bool(corr.contrib.isfinite().all())
    assert corr.n_tokens == n_tokens
    both = (corr.count > 0) & (count > 0)  # a half-precision top-k tie may flip a head's activity on a token
    assert float((corr.count - count).abs().sum()) <= 0.02 * float(count.sum())
    want = total[both] / count[both][:, None]
    assert float((corr.contrib[both].double() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    top = collect_top_activations(rm, LAYER, ids, n_top=3, distinct_windows=False, attention_mask=mask)
    zs = torch.cat([_z_alone(hf, adapter, lorsa, p)[1:] for p in prompts])
    want_top = zs.topk(3, dim=0).values.T
    assert float((top.values - want_top).abs().max()) <= 1e-2 * float(zs.abs().max())


def test_an_fp16_overflow_is_a_named_error_not_nan_correlations():
    """An fp16 Lorsa whose values overflow (``z`` = inf): the least squares ended in torch's ``RuntimeError: false
    INTERNAL ASSERT FAILED`` (MKL's ``DGELSD`` refusing a NaN); now NonFiniteError naming the layer."""
    _, hf, adapter, _, _ = _setup("llama")
    model, hf16 = tiny_nnsight("llama", dtype=torch.float16)
    lorsa = make_lorsa(hf, adapter).half()
    with torch.no_grad():
        lorsa.W_V.mul_(3e4)
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    with pytest.raises(NonFiniteError, match="NaN / inf"):
        mhsa_correlation(rm, LAYER, torch.randint(2, VOCAB, (2, 6)))


def test_fp16_activations_over_many_tokens_count_exactly():
    """``TopActivations.update`` with fp16 ``z`` over 2**17 tokens: counts and ``n_tokens`` are integers (no fp16
    sum saturating at 2048 / 65504)."""
    from nnsight_lorsa.analysis import TopActivations

    top = TopActivations.empty(3, 2)
    z = torch.zeros(4, 2**15, 3, dtype=torch.float16)
    z[..., 0] = 1.0
    z[:, ::2, 1] = 0.5
    top.update(z, 0)
    assert top.n_tokens == 2**17 and top.count.tolist() == [2**17, 2**16, 0]
    assert float(top.frequency[0]) == 1.0 and float(top.frequency[1]) == 0.5


# ------------------------------------------------------------------------------------------------ degenerate
@torch.no_grad()
def test_degenerate_inputs():
    """One-token prompts, a row of padding only, ``n_top`` above the tokens, a head that never fires, features that
    never fire: finite documented results, nothing at padding."""
    _, hf, adapter, lorsa, rm = _setup()
    prompts = [torch.tensor([0]), torch.tensor([], dtype=torch.long), torch.tensor([0, 5, 9])]
    ids, mask, _ = _pad(prompts, ["left", "right", "right"])
    top = collect_top_activations(rm, LAYER, ids, n_top=10, skip_start=0, attention_mask=mask)
    assert top.n_tokens == 4
    zs = torch.cat([_z_alone(hf, adapter, lorsa, p) for p in prompts if len(p)])
    assert torch.equal(top.count, (zs > 0).sum(0))
    assert bool((top.values[:, 2:] == float("-inf")).all()) and bool((top.window[:, 2:] == -1).all())
    assert set(top.window[:, :2].flatten().tolist()) <= {0, 2}  # distinct windows: never the padding row
    corr = mhsa_correlation(rm, LAYER, ids, attention_mask=mask)
    assert corr.n_tokens == 2 and bool(corr.contrib.isfinite().all())
    assert bool((corr.heads_spanned()[corr.count == 0] == 0).all())
    sae = make_sae(d_in=lorsa.cfg.d_model, d_sae=16, activation="topk", activation_params={"k": 4})
    res = qk_feature_impacts(rm, LAYER, 0, sae, ids, attention_mask=mask)
    assert res.n_tokens == 2 and bool(res.q_kl.isfinite().all()) and bool(res.k_kl.isfinite().all())
    never = (res.q_count == 0)
    assert bool((res.q_kl[never] == 0).all()) and bool((res.q_window[never] == -1).all())
    assert len(res.top_query_features(100)) == int((res.q_count > 0).sum())


@torch.no_grad()
def test_dashboard_contexts_of_a_left_padded_batch():
    """``head_dashboard_data(..., attention_mask=)`` recomputes each context on its row's tokens alone: the listed
    ``z`` is the prompt-alone hooked ``z`` at the entry's token, the per-token contributions sum to it, and the text
    holds no padding. Without the mask a left-padded context was recomputed with its pads as tokens (its
    contributions no longer summed to the listed ``z``)."""
    from nnsight_lorsa.viz import head_dashboard_data

    _, hf, adapter, lorsa, rm = _setup()
    prompts = _prompts([4, 9, 6], 8)
    ids, mask, offsets = _pad(prompts, ["left", "left", "left"])
    zs = [_z_alone(hf, adapter, lorsa, p) for p in prompts]
    top = collect_top_activations(rm, LAYER, ids, n_top=3, attention_mask=mask)
    head = top.top_heads(1)[0]
    data = head_dashboard_data(rm, LAYER, head, top, ids, attention_mask=mask, n_contexts=3, lens_k=2)
    assert data["contexts"]
    for c in data["contexts"]:
        w, col = c["window"], c["position"]
        i = col - offsets[w]
        assert abs(c["z"] - float(zs[w][i, head])) <= 1e-4
        assert abs(sum(c["contrib"]) - c["z"]) <= 1e-3 and len(c["contrib"]) == i + 1
    with pytest.raises(ArgumentError, match="is padding"):
        head_dashboard_data(rm, LAYER, head, top, ids, attention_mask=_padding_at_the_best_entry(mask, top, head))


def _padding_at_the_best_entry(mask: torch.Tensor, top, head: int) -> torch.Tensor:
    """A left-padding mask under which ``top``'s best entry of ``head`` is padding (one more pad on its row)."""
    w, col = int(top.window[head, 0]), int(top.position[head, 0])
    other = mask.clone()
    other[w, :col + 1] = 0
    return other
