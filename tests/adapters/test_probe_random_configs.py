"""Random-configs probe: the library on *drawn* transformers configurations of every adapter family
(:func:`helpers.drawn_configs`: ``d_model`` odd and even, MHA / GQA / MQA, a ``head_dim`` of its own, biases, tied
embeddings, 1–4 layers, partial rotary, parallel residual, GPT-2's scale options, sliding windows shorter and longer
than the prompt, soft-caps), not the fixed tiny configs of ``tiny_config``. Each check is against a plain-PyTorch /
plain-Hugging-Face reference (forward hooks, ``output_attentions``), never the code under test:

1. ``error=True`` with no edit (Lorsa, transcoder, SAE, CLT): the plain model's logits bit for bit;
2. without error terms: the same modules spliced in by plain forward hooks give the same logits;
3. a Lorsa configured and initialised from the MHSA has each QK head's pattern equal to its MHSA head's eager
   attention weights;
4. attribution: each row's edges (+ residual) sum to the node's value, the logit nodes are the plain model's
   demeaned logits;
5. save → load (our format): bit-equal forwards.

The default run takes a few fixed draws (``generated``: a handful of examples); ``-m slow`` sweeps hundreds.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    attention_call_args,
    drawn_clt,
    drawn_configs,
    drawn_hf_model,
    generated,
    head_logits,
    hooked,
    make_lorsa,
    make_sae,
    make_transcoders,
    nnsight_of,
    partial_rotary_refused,
    relative,
    unembed,
)
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from nnsight_lorsa import Lorsa, LorsaConfig, ReplacementModel, get_adapter, load, save
from nnsight_lorsa.errors import UnsupportedArchitectureError


def prompt(n: int, seed: int) -> torch.Tensor:
    ids = torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 0
    return ids


def sae_site(adapter, layer: int) -> str:
    """A norm's output (OLMo-2 has no pre-norm: its post-attention norm)."""
    return adapter.attention_norm_path(layer) or adapter.attention_post_norm_path(layer)


def event(what: str) -> None:
    """``hypothesis.event`` inside a generated test (``--hypothesis-show-statistics``), nothing in a fixed one."""
    with contextlib.suppress(InvalidArgument):
        hypothesis_event(what)


def build(drawn, seed: int, attn: str = "eager"):
    """(family, HF model, nnsight model, adapter) of a drawn config; a drawn odd partial-rotary size must be refused
    (named) by the adapter, and the draw ends there (``pytest.skip`` is not used: hypothesis would count it a
    failure; the caller returns on None)."""
    family, cfg = drawn
    hf = drawn_hf_model(cfg, seed, "eager" if family == "gemma2" else attn)
    adapter = get_adapter(hf)
    window = getattr(cfg, "sliding_window", None)
    event(f"{family}{' refused' if partial_rotary_refused(cfg) else ''}")
    event(f"GQA {getattr(cfg, 'num_key_value_heads', None) or cfg.num_attention_heads}/{cfg.num_attention_heads}, "
          f"head_dim {'own' if adapter.head_dim * adapter.n_heads != adapter.d_model else 'd/n'}, "
          f"window {'none' if not window else '<= 8' if window <= 8 else '> 8'}, "
          f"d_model {'odd' if adapter.d_model % 2 else 'even'}")  # --hypothesis-show-statistics: what was drawn
    if partial_rotary_refused(cfg):
        with pytest.raises(UnsupportedArchitectureError, match="partial_rotary_factor"):
            adapter.mhsa_weights(hf, 0)
        return None
    return family, hf, nnsight_of(hf), adapter


def replaced_logits(rm: ReplacementModel, model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), rm.trace(ids):
        rm.replace()
        out = unembed(model).output.save()
    return out


@torch.no_grad()
def reference_logits(hf, adapter, ids, lorsas=None, tcs=None, saes=None, clt=None) -> torch.Tensor:
    """The plain model's unembedding output with the modules spliced in by plain forward hooks (no nnsight)."""
    handles = []
    for layer, tc in (tcs or {}).items():
        handles.append(adapter.mlp_module(hf, layer).register_forward_hook(
            lambda m, a, k, out, tc=tc: adapter.with_mlp_output(out, tc(adapter.mlp_input(a, k))), with_kwargs=True))
    for path, sae in (saes or {}).items():
        handles.append(hf.get_submodule(path).register_forward_hook(lambda m, a, out, sae=sae: sae(out)))
    if clt is not None:
        acts: list[torch.Tensor] = []

        def clt_hook(m, a, k, out, layer):  # type: ignore[no-untyped-def]
            x = adapter.mlp_input(a, k)
            acts.append(clt.encode_layer(x, layer))
            return adapter.with_mlp_output(out, clt.reconstruct_layer(acts, layer, x))
        for layer in range(adapter.n_layers):
            handles.append(adapter.mlp_module(hf, layer).register_forward_hook(
                lambda m, a, k, out, layer=layer: clt_hook(m, a, k, out, layer), with_kwargs=True))
    try:
        with hooked(hf, adapter, lorsas or {}):
            return head_logits(hf, ids)
    finally:
        for h in handles:
            h.remove()


def modules_for(hf, adapter, layer: int, seed: int):
    d = adapter.d_model
    lorsas = {layer: make_lorsa(hf, adapter, layer, seed)}
    tcs = make_transcoders((layer,), d_model=d, seed=seed, skip_layer=layer if seed % 2 else None)
    saes = {sae_site(adapter, layer): make_sae(seed, d_in=d)}
    return lorsas, tcs, saes


# ---- 1 and 2: error terms exact; without them, the splice equals plain hooks ---------------------------------------

def check_splices(drawn, seed: int, layer_pick: int, n: int, dtype: torch.dtype = torch.float32,
                  attn: str = "eager") -> None:
    built = build(drawn, seed, attn)
    if built is None:
        return
    family, hf, model, adapter = built
    layer = layer_pick % adapter.n_layers
    lorsas, tcs, saes = modules_for(hf, adapter, layer, seed)
    clt = drawn_clt(adapter.n_layers, 24, "jumprelu" if seed % 2 else "topk", bool(seed % 3), seed,
                    d_model=adapter.d_model)
    if dtype != torch.float32:
        hf.to(dtype)
    ids = prompt(n, seed)
    plain = head_logits(hf, ids)
    for kwargs in ({"lorsas": lorsas, "transcoders": tcs, "saes": saes}, {"transcoders": clt}):
        rm = ReplacementModel(model, **kwargs, error=True)
        got = replaced_logits(rm, model, ids)
        assert torch.equal(got, plain), (family, drawn[1], layer, list(kwargs), relative(got, plain))
    if dtype != torch.float32:
        return
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs, saes=saes, error=False)
    got, ref = replaced_logits(rm, model, ids), reference_logits(hf, adapter, ids, lorsas, tcs, saes)
    assert relative(got, ref) < 1e-5, (family, drawn[1], layer, relative(got, ref))
    assert relative(ref, plain) > 1e-4  # the splice changes the logits: the check is not vacuous
    rm = ReplacementModel(model, transcoders=clt, error=False)
    got, ref = replaced_logits(rm, model, ids), reference_logits(hf, adapter, ids, clt=clt)
    assert relative(got, ref) < 1e-5, (family, drawn[1], "clt", relative(got, ref))


@generated(3, 200, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), layer=st.integers(0, 3),
           n=st.integers(1, 20), attn=st.sampled_from(["eager", "sdpa"]))
def test_drawn_models_splice_exactly(drawn, seed, layer, n, attn):
    check_splices(drawn, seed, layer, n, attn=attn)


@generated(1, 40, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), layer=st.integers(0, 3),
           n=st.integers(1, 20))
def test_drawn_bf16_models_keep_their_logits_with_error_terms(drawn, seed, layer, n):
    check_splices(drawn, seed, layer, n, torch.bfloat16)


# ---- 3: Lorsa from the MHSA has the MHSA's patterns ----------------------------------------------------------------

def check_patterns(drawn, seed: int, layer_pick: int, n: int) -> None:
    built = build(drawn, seed)
    if built is None:
        return
    family, hf, _, adapter = built
    if family == "olmo2":  # whole-projection QK-norm: near, not at (documented, docs/adapters.md)
        return
    layer = layer_pick % adapter.n_layers
    attn = adapter.attention_module(hf, layer)
    if getattr(attn, "attn_logit_softcapping", None) is not None:  # a Lorsa has no soft-cap: its uncapped pattern
        attn.attn_logit_softcapping = None
    window = adapter.sliding_window(layer) if hasattr(adapter, "sliding_window") else None
    n = min(n, window) if window else n  # a Lorsa is global: the MHSA's window must not bite
    seen = {}
    def capture(m, a, k):  # type: ignore[no-untyped-def]
        x = adapter.attention_input(a, k)
        seen.update(x=x, pos=adapter.attention_positions(a, k, x))
    handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            own = hf(prompt(n, seed), output_attentions=True).attentions[layer]
    finally:
        handle.remove()
    w = adapter.mhsa_weights(hf, layer)
    rep = 1 + seed % 3
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=rep * w.n_heads * 2, top_k=1, qk_heads_per_mhsa_head=rep, layer=layer)
    lorsa = Lorsa(cfg)
    lorsa.init_from_mhsa(w, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = lorsa.attention_pattern(seen["x"], positions=seen["pos"])
    ref = own.repeat_interleave(rep, 1)
    assert got.shape == ref.shape, (family, got.shape, ref.shape)
    gap = float((got.double() - ref.double()).abs().sum(-1).max())
    assert gap < 1e-5, (family, drawn[1], layer, gap)


@generated(4, 300, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), layer=st.integers(0, 3),
           n=st.integers(2, 24))
def test_a_lorsa_from_the_mhsa_has_its_patterns_on_drawn_models(drawn, seed, layer, n):
    check_patterns(drawn, seed, layer, n)


def check_mhsa_recompute(drawn, seed: int, n: int, attn_impl: str) -> None:
    """``mhsa_forward`` of ``mhsa_weights`` (the frozen MHSA of attribution, QK tracing, head analysis) on each
    layer's captured input equals that attention module's own output (windows biting, soft-caps, any head layout)."""
    from nnsight_lorsa.adapters.base import mhsa_forward

    built = build(drawn, seed, attn_impl)
    if built is None:
        return
    family, hf, _, adapter = built
    seen: dict[int, tuple] = {}

    def capture(m, a, k, out, layer):  # type: ignore[no-untyped-def]
        x = adapter.attention_input(a, k)
        seen[layer] = (x, adapter.attention_positions(a, k, x), adapter.attention_output(out))
    handles = [adapter.attention_module(hf, i).register_forward_hook(
        lambda m, a, k, out, i=i: capture(m, a, k, out, i), with_kwargs=True) for i in range(adapter.n_layers)]
    try:
        with torch.no_grad():
            hf(prompt(n, seed))
    finally:
        for h in handles:
            h.remove()
    for layer, (x, pos, out) in seen.items():
        with torch.no_grad():
            got = mhsa_forward(adapter.mhsa_weights(hf, layer), x, pos)
        assert relative(got, out) < 1e-5, (family, drawn[1], layer, relative(got, out))


@generated(3, 300, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), n=st.integers(1, 30),
           attn=st.sampled_from(["eager", "sdpa"]))
def test_the_frozen_mhsa_is_the_attention_on_drawn_models(drawn, seed, n, attn):
    check_mhsa_recompute(drawn, seed, n, attn)


def check_recipe_init(drawn, seed: int, layer_pick: int, n: int, mode: str) -> None:
    """``init_lorsa`` (the training recipe's initialisation, ``value_svd`` by default) on the layer's captured
    input / output of a short first batch — fewer counted tokens than ``head_dim``, or ``head_dim > d_model``, gives
    fewer principal directions than ``d_head`` (was a bare ``RuntimeError``: ``c @ basis`` shapes): each OV head's
    ``w_v`` (``value_svd``) / ``w_o`` (``output_svd``) is a finite vector in its MHSA head's value / output space
    (least squares against ``W_V^m`` / ``W_O^m``, plain torch)."""
    from nnsight_lorsa.training.lorsa_recipe import LorsaRecipe, init_lorsa

    built = build(drawn, seed)
    if built is None:
        return
    family, hf, _, adapter = built
    layer = layer_pick % adapter.n_layers
    seen = {}

    def capture(m, a, k, out):  # type: ignore[no-untyped-def]
        x = adapter.attention_input(a, k)
        seen.update(x=x, pos=adapter.attention_positions(a, k, x), y=adapter.attention_output(out))
    handle = adapter.attention_module(hf, layer).register_forward_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(prompt(n, seed))
    finally:
        handle.remove()
    w = adapter.mhsa_weights(hf, layer)
    lorsa = make_lorsa(hf, adapter, layer, seed)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[:, 0] = False
    init_lorsa(lorsa, seen["x"], seen["y"], mask, s_in=1.0, s_out=1.0, mhsa=w, recipe=LorsaRecipe(ov_init=mode),
               positions=seen["pos"], generator=torch.Generator().manual_seed(seed))
    per_head = lorsa.cfg.n_ov_heads // w.n_heads
    kv_rep = w.n_heads // w.n_kv_heads
    for m in range(w.n_heads):
        rows = slice(m * per_head, (m + 1) * per_head)
        vec, space = ((lorsa.W_V[rows], w.W_V[m // kv_rep]) if mode == "value_svd" else
                      (lorsa.W_O[rows], w.W_O[m].T))                     # (per_head, d), (d, e)
        vec, space = vec.detach().double(), space.double()
        assert torch.isfinite(vec).all()
        fit = space @ torch.linalg.lstsq(space, vec.T).solution            # the projection onto the space
        assert float((fit - vec.T).norm(dim=0).max()) < 1e-4 * float(vec.norm(dim=1).max()), (family, drawn[1], m)


@generated(2, 150, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), layer=st.integers(0, 3),
           n=st.integers(2, 40), mode=st.sampled_from(["value_svd", "output_svd"]))
def test_the_recipe_init_takes_any_first_batch_on_drawn_models(drawn, seed, layer, n, mode):
    check_recipe_init(drawn, seed, layer, n, mode)


def test_the_recipe_init_takes_a_batch_shorter_than_the_head():
    """The fixed case: a Qwen3 head of 32 dims, 6 counted tokens, both SVD modes (seen failing before the fix:
    ``RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x32 and 6x48)``)."""
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   num_hidden_layers=1, vocab_size=128, intermediate_size=32,
                                   max_position_embeddings=64)
    for mode in ("value_svd", "output_svd"):
        check_recipe_init(("qwen3", cfg), seed=0, layer_pick=0, n=7, mode=mode)


# ---- 4: attribution ------------------------------------------------------------------------------------------------

def check_attribution(drawn, seed: int, layer_pick: int, n: int, budget: int | None, attn: str = "eager") -> None:
    from nnsight_lorsa.attribution import attribute

    built = build(drawn, seed, attn)
    if built is None:
        return
    family, hf, model, adapter = built
    layer = layer_pick % adapter.n_layers
    lorsas, tcs, _ = modules_for(hf, adapter, layer, seed)
    # fp64: a relative bound of 1e-9 (fp32's rounding inside one edge's dot product, relative to the edge, reaches
    # 1e-5 where d_model is small and terms cancel); not GPT-2's reordered upcast attention (transformers' own
    # forward refuses fp64: "Error with upcasting"): fp32 and 1e-3 there
    wide = not getattr(hf.config, "reorder_and_upcast_attn", False)
    if wide:
        hf.double()
        for m in [*lorsas.values(), *tcs.values()]:
            m.double()
    ids = prompt(n, seed)[0]
    g = attribute(ReplacementModel(model, lorsas=lorsas, transcoders=tcs), ids, batch_size=32,
                  max_feature_nodes=budget, progress=False)
    rows = g.feature_rows.nonzero().flatten()
    dense = g.densify().double()[rows]
    resid = g.residual[rows].double() if g.residual is not None else torch.zeros(len(rows), dtype=torch.float64)
    sums, values = dense.sum(-1) + resid, g.values[rows].double()
    mass = dense.abs().sum(-1) + resid.abs()
    assert float(((sums - values).abs() / mass.clamp_min(1e-30)).max()) < (1e-9 if wide else 1e-3), (family, drawn[1])
    # logit nodes: the plain model's demeaned (uncapped) logits at the last position, within 1e-6: transformers'
    # RMSNorms normalise in fp32 whatever the input (``.to(torch.float32)``), the frozen norms keep fp64, so the fp64
    # model's own logits carry fp32 rounding (1e-7 relative, on the fixed tiny Llama too)
    logits = head_logits(hf, ids[None])[0, -1].double()
    want = logits[g.nodes.index[g.logit_ids]] - logits.mean()
    assert relative(g.values[g.logit_ids].double(), want) < (1e-6 if wide else 1e-4), (family, drawn[1])


@generated(2, 100, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), layer=st.integers(0, 3),
           n=st.integers(2, 9), budget=st.sampled_from([None, 4, 16]), attn=st.sampled_from(["eager", "sdpa"]))
def test_attribution_rows_sum_on_drawn_models(drawn, seed, layer, n, budget, attn):
    check_attribution(drawn, seed, layer, n, budget, attn)


def check_qk(drawn, seed: int, layer_pick: int, n: int, head_pick: int, q_pick: int, k_pick: int) -> None:
    """QK attribution of a drawn Lorsa head: the score is the Lorsa's own ``q·k / scale`` on the model's captured
    attention input (fp64), and the node pairs sum to it."""
    from nnsight_lorsa.attribution.qk import qk_attribution

    built = build(drawn, seed)
    if built is None:
        return
    family, hf, model, adapter = built
    if getattr(hf.config, "reorder_and_upcast_attn", False):  # transformers' own forward refuses fp64 there
        return
    layer = layer_pick % adapter.n_layers
    lorsas, tcs, _ = modules_for(hf, adapter, layer, seed)
    hf.double()
    for m in [*lorsas.values(), *tcs.values()]:
        m.double()
    ids = prompt(n, seed)[0]
    lor = lorsas[layer]
    head, qpos = head_pick % lor.cfg.n_ov_heads, q_pick % n
    kpos = k_pick % (qpos + 1)
    r = qk_attribution(ReplacementModel(model, lorsas=lorsas, transcoders=tcs), ids, layer=layer, head=head,
                       query_pos=qpos, key_pos=kpos)
    args, kwargs = attention_call_args(hf, adapter, layer, ids[None])
    x = adapter.attention_input(args, kwargs)
    with torch.no_grad():
        q, k = lor.qk(x, adapter.attention_positions(args, kwargs, x))
    g = head // lor.cfg.group_size
    ref = float(q[0, g, qpos] @ k[0, g, kpos]) / lor.cfg.scale
    assert abs(r.score - ref) < 1e-6 * max(1.0, abs(ref)), (family, drawn[1], r.score, ref)
    assert abs(float(r.pairs.sum()) - r.score) < 1e-9 * max(1.0, float(r.pairs.abs().sum())), (family, drawn[1])


@generated(2, 100, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), layer=st.integers(0, 3), n=st.integers(1, 9),
           head=st.integers(0, 10 ** 6), qpos=st.integers(0, 10 ** 6), kpos=st.integers(0, 10 ** 6))
def test_qk_attribution_sums_to_the_score_on_drawn_models(drawn, seed, layer, n, head, qpos, kpos):
    check_qk(drawn, seed, layer, n, head, qpos, kpos)


# ---- 5: save -> load -----------------------------------------------------------------------------------------------

def check_round_trip(drawn, seed: int, layer_pick: int, tmp: object) -> None:
    from pathlib import Path

    built = build(drawn, seed)
    if built is None:
        return
    family, hf, _, adapter = built
    layer = layer_pick % adapter.n_layers
    lorsas, tcs, saes = modules_for(hf, adapter, layer, seed)
    clt = drawn_clt(adapter.n_layers, 24, "topk", True, seed, d_model=adapter.d_model)
    x = torch.randn(2, 7, adapter.d_model, generator=torch.Generator().manual_seed(seed))
    for i, module in enumerate([lorsas[layer], tcs[layer], *saes.values(), clt]):
        back = load(save(module, Path(str(tmp)) / f"m{i}"))
        inp = x.expand(adapter.n_layers, *x.shape) if module is clt else x
        with torch.no_grad():
            a, b = module(inp), back(inp)
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        assert torch.equal(a, b), (family, type(module).__name__)
        if isinstance(module, Lorsa):
            assert back.cfg == module.cfg


@generated(2, 60, drawn=drawn_configs(), seed=st.integers(0, 2 ** 16), layer=st.integers(0, 3))
def test_drawn_modules_round_trip_bit_equal(drawn, seed, layer, tmp_path_factory):
    check_round_trip(drawn, seed, layer, tmp_path_factory.mktemp("rt"))


# ---- partial rotary: only where the family applies it; an odd size refused by name --------------------------------

#: the families whose transformers attention rotates the whole head whatever ``partial_rotary_factor`` says
WHOLE_HEAD = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2")


def _whole_head_config(family: str, factor: float):  # type: ignore[no-untyped-def]
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config,
           "olmo2": transformers.Olmo2Config}[family]
    return cls(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
               vocab_size=128, intermediate_size=32, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
               eos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": factor})


@pytest.mark.parametrize("family", WHOLE_HEAD)
def test_a_partial_rotary_factor_the_family_ignores_is_ignored(family):
    """transformers' Llama, Mistral, Qwen2/3, Gemma(-2) and OLMo-2 attention rotate the whole head (their rotary
    modules never read ``partial_rotary_factor``); the adapter read it for every Llama-like family (for Phi-3's sake),
    so a model whose config carries it was refused (``ConfigMismatchError``: buffer shape 4 != 2) with real weights
    and, on ``meta`` (no buffer values to check), got a RoPE on half of each head: its Lorsa's QK patterns off the
    model's. Now the whole head rotates, as the model; the Lorsa's patterns are the model's eager weights."""
    import transformers

    cfg = _whole_head_config(family, 0.5)
    with torch.device("meta"):
        on_meta = transformers.AutoModelForCausalLM.from_config(cfg)
    rot = get_adapter(on_meta).mhsa_weights(on_meta, 1).rotary
    assert rot is not None and rot.rotary_dim == 8, (family, rot)
    drawn = (family, cfg)
    check_patterns(drawn, seed=1, layer_pick=1, n=12)


@pytest.mark.parametrize("family,head_dim,factor", [("neox", 12, 0.25), ("phi3", 12, 0.25), ("phi3", 6, 0.5),
                                                    ("neox", 8, 0.1)])
def test_an_odd_or_empty_partial_rotary_size_is_refused_naming_the_field(family, head_dim, factor):
    """``int(head_dim * partial_rotary_factor)`` odd: transformers' rotary module then rotates the next even number
    of dims with frequencies ``base ** (-2i / odd)`` (no ``RotaryConfig`` describes them); zero: none. Refused with
    ``UnsupportedArchitectureError`` naming ``partial_rotary_factor`` and ``head_dim`` (was a ``CheckpointError``
    "rotary_dim must be even" from ``RotaryConfig``, naming no config field)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": factor}
    if family == "neox":
        cfg = transformers.GPTNeoXConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_hidden_layers=1,
                                         vocab_size=128, intermediate_size=32, rope_parameters=rope)
    else:
        cfg = transformers.Phi3Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=1, vocab_size=128, intermediate_size=32,
                                      rope_parameters=rope, pad_token_id=1, bos_token_id=0, eos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf(torch.zeros(1, 3, dtype=torch.long))  # the model itself runs
    adapter = get_adapter(hf)
    for call in (lambda: adapter.rotary_config(0), lambda: adapter.mhsa_weights(hf, 0)):
        with pytest.raises(UnsupportedArchitectureError, match=rf"partial_rotary_factor={factor} of "
                                                               rf"head_dim={head_dim}"):
            call()
