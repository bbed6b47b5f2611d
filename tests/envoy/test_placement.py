"""Device and dtype placement of every replacement kind, and bit-exact error terms in every dtype.

The contract (``envoy/splice_chain.py``): a set puts each module on its site's device (its dtype
kept), the splice casts inputs to the module's device and dtype and outputs back to the site's, and
``error=True`` returns the site's true output bit for bit when nothing is edited (the error term is
summed in fp32, never rounded to a bf16/fp16 model's dtype). Each case runs on the CPU and, as a
``gpu`` case, on CUDA where torch sees it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DEVICES,
    LAYER,
    make_clt,
    make_lorsa,
    make_sae,
    make_transcoders,
    tiny_hf_model,
    tiny_nnsight,
    unembed,
)

from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import PlacementError, ShapeError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _modules(family: str) -> tuple[dict, dict, dict]:
    """Lorsas, transcoders and SAEs made in fp32 on the CPU from the fp32 twin of the test model."""
    hf = tiny_hf_model(family)
    adapter = get_adapter(hf)
    lorsas = {layer: make_lorsa(hf, adapter, layer) for layer in range(adapter.n_layers)}
    # OLMo-2 has no pre-norms: its SAE on the attention's post-norm
    norm = adapter.attention_norm_path(0) or adapter.attention_post_norm_path(0)
    return lorsas, make_transcoders(range(adapter.n_layers), skip_layer=1), {norm: make_sae()}


def _logits(model, ids, rm=None, edit=None):
    with torch.no_grad(), model.trace(ids):
        if rm is not None:
            sites = rm.replace()
            if edit is not None:
                edit(sites)
        out = unembed(model).output.save()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("module_dtype", ["fp32", "model"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "olmo2", "phi3", "gemma"])
def test_error_terms_give_the_plain_logits_bit_for_bit(device, dtype, module_dtype, family):
    lorsas, tcs, saes = _modules(family)
    model, _ = tiny_nnsight(family, device=device, dtype=dtype)
    cast = dtype if module_dtype == "model" else torch.float32
    for m in (*lorsas.values(), *tcs.values(), *saes.values()):
        m.to(cast)
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs, saes=saes, error=True)
    for m in (*lorsas.values(), *tcs.values(), *saes.values()):  # placed on the layer's device, dtype kept
        assert {p.device.type for p in m.parameters()} == {torch.device(device).type}
        assert {p.dtype for p in m.parameters()} == {cast}
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    plain = _logits(model, ids)
    replaced = _logits(model, ids, rm)
    assert replaced.dtype == plain.dtype == dtype
    assert torch.equal(replaced, plain)
    rm.error = False  # not vacuous: the replacements do change the logits
    assert not torch.equal(_logits(model, ids, rm), plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_layer_transcoder_error_terms_are_bit_exact(device, dtype):
    model, _ = tiny_nnsight("llama", device=device, dtype=dtype)
    clt = make_clt()  # fp32 on the CPU: the set moves it to layer 0's device
    rm = ReplacementModel(model, transcoders=CLTSet(model, clt), error=True)
    assert clt.W_enc.device.type == torch.device(device).type and clt.W_enc.dtype == torch.float32
    ids = torch.randint(2, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(model, ids, rm), _logits(model, ids))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_head_ablation_under_error_terms_matches_the_hook_reference(device, dtype):
    """``error=True`` + zeroing Lorsa heads: the attention returns ``MHSA + (edited Lorsa − clean Lorsa)``
    summed in fp32 and cast to the model's dtype — the same sum by a plain PyTorch hook on the same model
    gives the same logits (relative bound 1e-6 of max |logit|: the same operations in the same order)."""
    lorsas, _, _ = _modules("llama")
    lorsa = lorsas[LAYER]
    heads = torch.arange(0, lorsa.cfg.n_ov_heads, 3)
    ids = torch.randint(2, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    model, hf = tiny_nnsight("llama", device=device, dtype=dtype)
    adapter = get_adapter(model)
    lorsa.to(device)

    def exact_hook(module, args, kwargs, output):
        x = adapter.attention_input(args, kwargs).float()
        pos = adapter.attention_positions(args, kwargs, x)
        z, _ = lorsa.activation(lorsa.compute_z_pre(x, pos, adapter.attention_mask(args, kwargs)))
        edited = z.clone()
        edited[..., heads] = 0
        true = adapter.attention_output(output)
        out = (true.float() + (lorsa.decode(edited) - lorsa.decode(z))).to(true.dtype)
        return adapter.with_attention_output(output, out)

    h = adapter.attention_module(hf, LAYER).register_forward_hook(exact_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            want = hf(ids.to(device)).logits.float()
    finally:
        h.remove()
    with torch.no_grad():
        plain = hf(ids.to(device)).logits.float()
    assert (want - plain).abs().max() > 1e-2 * plain.abs().max()  # the edit matters

    rm = ReplacementModel(model, lorsas={LAYER: lorsa}, error=True)

    def edit(sites):
        sites["lorsas"][LAYER].hook_z.output[..., heads] = 0

    got = _logits(model, ids, rm, edit).float()
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-6, (dtype, err)


@pytest.mark.parametrize("device", DEVICES)
def test_error_node_is_carried_in_fp32_on_the_site_device(device):
    model, hf = tiny_nnsight("llama", device=device, dtype=torch.bfloat16)
    lorsas, _, _ = _modules("llama")
    lorsa = lorsas[LAYER]
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), model.trace(ids):
        site = LorsaSet(model, {LAYER: lorsa}).replace(layer=LAYER, error=True)
        out = site.hook_out.output.save()
        err = site.hook_error.output.save()
        mhsa = model.model.layers[LAYER].self_attn.output[0].save()
    assert err.dtype == torch.float32 and err.device.type == torch.device(device).type
    # MHSA = Lorsa + error, exactly in fp32 arithmetic on the bf16 MHSA output
    assert float((out.float() + err - mhsa.float()).abs().max()) <= 1e-6 * float(mhsa.float().abs().max())
    assert float(err.abs().max()) > 1e-3 * float(mhsa.float().abs().max())  # a real error term


def test_a_meta_module_raises_placement_error_naming_it():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter, LAYER).to("meta")
    with pytest.raises(PlacementError, match=r"Lorsa for model.layers.1.self_attn.*meta"):
        LorsaSet(model, {LAYER: lorsa})
    with pytest.raises(PlacementError, match=r"Transcoder for model.layers.0.mlp.*meta"):
        TranscoderSet(model, {0: make_transcoders([0])[0].to("meta")})
    with pytest.raises(PlacementError, match=r"SparseAutoencoder.*meta"):
        SAESet(model, {"model.layers.0": make_sae().to("meta")})
    with pytest.raises(PlacementError, match=r"CrossLayerTranscoder.*meta"):
        CLTSet(model, make_clt().to("meta"))


def test_a_module_made_meta_after_insertion_raises_at_the_splice_and_leaves_the_model_clean():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter, LAYER)
    lorsas = LorsaSet(model, {LAYER: lorsa})
    lorsa.to("meta")
    before = sorted(n for n, _ in hf.named_modules())
    with pytest.raises(PlacementError, match="meta"), model.trace(torch.tensor([[0, 5, 6, 7]])):
        lorsas.replace(layer=LAYER)
        unembed(model).output.save()
    assert sorted(n for n, _ in hf.named_modules()) == before


def test_an_undispatched_model_places_the_modules_at_the_first_trace(tmp_path):
    """nnsight loads a model's weights lazily (``dispatch=False``: ``meta`` until the first trace): the
    set keeps the modules where they are, the splice places them when the trace reaches their site."""
    import warnings

    from nnsight import TransformersModel

    from nnsight_lorsa.assets import default_lorsa_dir, default_model_dir
    from nnsight_lorsa.envoy.tokens import load_tokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = str(default_model_dir())
        lazy = TransformersModel(path, task="text-generation", tokenizer=load_tokenizer(path), dispatch=False,
                                 dtype=torch.float32, device="cpu")
    assert next(lazy._module.parameters()).device.type == "meta"
    lorsas = LorsaSet.from_pretrained(lazy, default_lorsa_dir())
    layer = lorsas.layers[0]
    assert lorsas[layer].W_Q.device.type == "cpu" and lorsas[layer].W_Q.dtype == torch.float32
    ids = torch.tensor([[0, 10, 11, 12, 13]])
    with torch.no_grad(), lazy.trace(ids):
        lorsas.replace(layer=layer, error=True)
        got = lazy.lm_head.output.save()
    with torch.no_grad(), lazy.trace(ids):
        plain = lazy.lm_head.output.save()
    assert torch.equal(got, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_from_pretrained_reads_modules_in_the_model_dtype_unless_told(dtype, device):
    """The embedded model loaded by ``load_model(device=, dtype=)``: the packaged Lorsas and transcoders land on
    its device in its dtype (``dtype=`` overrides the dtype, not the device); error terms are bit-exact."""
    from nnsight_lorsa.assets import default_lorsa_dir, default_transcoder_dir
    from nnsight_lorsa.envoy import load_model

    model = load_model(device=device, dtype=dtype)
    lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir())
    tcs = TranscoderSet.from_pretrained(model, default_transcoder_dir())
    where = torch.device(device).type
    assert {(p.device.type, p.dtype) for m in (*lorsas.values(), *tcs.values()) for p in m.parameters()} == \
        {(where, dtype)}
    kept = LorsaSet.from_pretrained(model, default_lorsa_dir(), dtype=torch.float32)
    assert {(p.device.type, p.dtype) for m in kept.values() for p in m.parameters()} == {(where, torch.float32)}
    ids = torch.tensor([[0, 10, 11, 12, 13, 14, 15]])
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs, error=True)
    assert torch.equal(_logits(model, ids, rm), _logits(model, ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_set_follows_the_model_to_cuda_and_back():
    model, hf = tiny_nnsight("llama")
    lorsas, tcs, _ = _modules("llama")
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs, error=True)
    ids = torch.randint(2, 128, (1, 16), generator=torch.Generator().manual_seed(8))
    cpu = _logits(model, ids, rm)
    hf.to("cuda")
    rm.lorsas.place()
    rm.transcoders.place()
    assert all(p.is_cuda for m in (*lorsas.values(), *tcs.values()) for p in m.parameters())
    got = _logits(model, ids, rm)
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-4, atol=1e-4 * float(cpu.abs().max()))


def test_every_set_saves_and_loads_back_at_its_keys(tmp_path):
    """One ``save`` for every kind (``ReplacementSet.save``; ``CLTSet.save``): each module comes back at its
    key from its folder name (``layer_<L>``, the site path), with equal weights."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas, tcs, _ = _modules("llama")
    for m in tcs.values():
        m.cfg.layer = None  # the folder name alone says where it goes
    sets = {"lorsas": LorsaSet(model, lorsas), "tcs": TranscoderSet(model, tcs),
            "saes": SAESet(model, {"model.layers.0": make_sae(), adapter.attention_norm_path(1): make_sae(seed=1)})}
    for name, s in sets.items():
        s.save(tmp_path / name)
        back = type(s).from_pretrained(model, tmp_path / name)
        assert list(back) == list(s), name
        for key in s:
            a, b = s[key].state_dict(), back[key].state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, key)
    clt = CLTSet(model, make_clt())
    clt.save(tmp_path / "clt")
    back_clt = CLTSet.from_pretrained(model, tmp_path / "clt")
    assert all(torch.equal(v, back_clt.clt.state_dict()[k]) for k, v in clt.clt.state_dict().items())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_offloaded_sets_of_every_kind_replace_as_the_resident_ones(device, dtype):
    """``ReplacementModel(..., offload=True)`` with Lorsas, transcoders, an SAE — and, separately, a cross-layer
    transcoder, whose per-layer views are fetched through their ``weights_owner`` — on a model on ``device``
    in ``dtype``: the modules stay on the host in their dtype (pinned where CUDA is), the error terms give the
    plain logits bit for bit, and without them the logits are the resident modules' bit for bit (the same
    module computes on the site's device, only fetched for the call)."""
    import copy

    model, _ = tiny_nnsight("llama", device=device, dtype=dtype)
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(9))
    plain = _logits(model, ids)
    lorsas, tcs, saes = _modules("llama")
    clt = make_clt()
    for m in (*lorsas.values(), *tcs.values(), *saes.values(), clt):
        m.to(dtype)
    bundles = [({"lorsas": lorsas, "transcoders": tcs, "saes": saes}, [*lorsas.values(), *tcs.values(),
                                                                         *saes.values()]),
               ({"transcoders": clt}, [clt])]  # a bare CLT: the ReplacementModel binds it in a CLTSet
    for kwargs, modules in bundles:
        resident = ReplacementModel(model, **copy.deepcopy(kwargs), error=False)
        want = _logits(model, ids, resident)
        off = ReplacementModel(model, **kwargs, error=True, offload=True)
        assert "saes" in kwargs or isinstance(off.transcoders, CLTSet)
        for m in modules:
            assert {(p.device.type, p.dtype) for p in m.parameters()} == {("cpu", dtype)}, type(m).__name__
            assert device == "cpu" or all(p.is_pinned() for p in m.parameters())
        got = _logits(model, ids, off)
        assert got.device.type == torch.device(device).type and torch.equal(got, plain), sorted(kwargs)
        off.error = False
        got = _logits(model, ids, off)
        assert torch.equal(got, want) and not torch.equal(got, plain), sorted(kwargs)
        assert all(p.device.type == "cpu" for m in modules for p in m.parameters())


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("error", [True, False])
def test_an_fp16_module_fed_values_past_fp16s_range_raises_naming_it(model_dtype, error):
    """The splice casts a site's input to the module's dtype: fp16 holds |x| <= 65504, so a wider model's
    residual past that (massive activations) would reach an fp16 SAE as inf and return NaN logits (with
    ``error=True`` too, where the docs promise the plain logits bit for bit). It raises PlacementError naming
    the site, the module and the dtypes; an fp32 module reads the same residual and keeps the contract."""
    model, hf = tiny_nnsight("gpt2", dtype=model_dtype)
    with torch.no_grad():  # a residual stream past 65504 (the block's LayerNorms keep the model finite)
        hf.transformer.wte.weight.mul_(1e6)
        hf.transformer.wpe.weight.mul_(1e6)
    ids = torch.randint(2, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    plain = _logits(model, ids)
    assert bool(torch.isfinite(plain).all())
    site = "transformer.h.1"
    wide = ReplacementModel(model, saes=SAESet(model, {site: make_sae()}), error=error)
    got = _logits(model, ids, wide)
    assert bool(torch.isfinite(got).all()) and (not error or torch.equal(got, plain))
    narrow = ReplacementModel(model, saes=SAESet(model, {site: make_sae().to(torch.float16)}), error=error)
    with pytest.raises(PlacementError, match=rf"{site}.*SparseAutoencoder.*float16"):
        _logits(model, ids, narrow)


def _kinds(hf, adapter):
    """``(set class, key, fresh module)`` makers for every replacement kind (fp32, on the CPU)."""
    return {
        "lorsa": (LorsaSet, LAYER, lambda: make_lorsa(hf, adapter, LAYER)),
        "transcoder": (TranscoderSet, 0, lambda: make_transcoders([0], skip_layer=0)[0]),
        "sae": (SAESet, "model.layers.1", make_sae),
        "clt": (CLTSet, None, lambda: make_clt(adapter.n_layers, skip=True)),
    }


def _one_param_cast(module, name, dtype):
    p = dict(module.named_parameters())[name]
    p.data = p.data.to(dtype)
    return module


@pytest.mark.parametrize("kind", ["lorsa", "transcoder", "sae", "clt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_a_module_with_parameters_in_several_dtypes_is_refused_naming_them(kind, dtype):
    """A module's parameters must share one floating dtype (the splice casts the site's input to it): one
    parameter cast on its own (``module.W_O.data = ….to(bf16)``) made the forward fail with torch's raw
    dtype mismatch (or a ShapeError about ``x``). Each parameter in turn: refused on insertion, and at the
    splice (naming the site) when cast after insertion; the model is left clean."""
    model, hf = tiny_nnsight("llama")
    cls, key, make = _kinds(hf, get_adapter(model))[kind]
    names = [n for n, p in make().named_parameters() if p.is_floating_point()]
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    for name in names:
        bad = _one_param_cast(make(), name, dtype)
        with pytest.raises(PlacementError, match=rf"several dtypes.*{name}"):
            cls(model, bad if key is None else {key: bad})
        module = make()
        rset = cls(model, module if key is None else {key: module})
        _one_param_cast(module, name, dtype)
        before = sorted(n for n, _ in hf.named_modules())
        with pytest.raises(PlacementError, match=rf"model\.layers\.\d.*several dtypes.*{name}"):
            _logits(model, ids, ReplacementModel(model, **{cls.slot: rset}, error=True))
        assert sorted(n for n, _ in hf.named_modules()) == before


@pytest.mark.parametrize("model_dtype", [torch.float16], ids=str)
@pytest.mark.parametrize("module_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("error", [True, False])
def test_a_wider_modules_output_past_the_sites_range_raises_naming_the_site(model_dtype, module_dtype, error):
    """The splice casts the module's output back to the site's dtype: an fp32 / bf16 SAE's reconstruction past
    fp16's range (|x| > 65504) on an fp16 model became inf there, then NaN logits, with no word (with
    ``error=True`` the same once an edit makes the output that large). It raises PlacementError naming the site,
    both dtypes and the largest value; the same module with outputs inside the range keeps the contract."""
    model, hf = tiny_nnsight("gpt2", dtype=model_dtype)
    ids = torch.randint(2, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    plain = _logits(model, ids)
    site = "transformer.h.1"
    sae = make_sae().to(module_dtype)
    rm = ReplacementModel(model, saes=SAESet(model, {site: sae}), error=error)
    got = _logits(model, ids, rm)  # within range: finite, and the plain logits under error terms
    assert bool(torch.isfinite(got).all()) and (not error or torch.equal(got, plain))
    with torch.no_grad():
        big = float(sae.W_dec.float().abs().max())
    if error:  # an edit that scales every feature: the edited reconstruction leaves fp16's range
        def edit(sites):
            sites["saes"][site].hook_sae_acts_post.output[:] *= 1e7
    else:
        edit = None
        with torch.no_grad():
            sae.W_dec.mul_(1e7)
    assert big * 1e7 > 65504  # the output would overflow (not vacuous)
    with pytest.raises(PlacementError, match=rf"{site}.*float16.*{str(module_dtype).split('.')[1]}|"
                                             rf"{site}.*{str(module_dtype).split('.')[1]}.*float16"):
        _logits(model, ids, rm, edit)


def test_the_output_range_check_reads_nothing_where_nothing_can_edit(monkeypatch):
    """The check of a module's output against an fp16 site's range reads one value (a device sync) per site and
    pass; with error terms and no edit the site returns its true output bit for bit, which cannot leave the range,
    so no read is made there — one per site once an edit is in the trace, and always without error terms."""
    from nnsight_lorsa.envoy import splice_chain

    calls = []
    real = splice_chain.past_range
    monkeypatch.setattr(splice_chain, "past_range", lambda x, dtype: calls.append(dtype) or real(x, dtype))
    model, _ = tiny_nnsight("gpt2", dtype=torch.float16)
    ids = torch.randint(2, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    site = "transformer.h.1"
    for error, edit, want in ((True, None, 0), (True, lambda s: s["saes"][site].hook_sae_acts_post.output.mul_(2), 1),
                              (False, None, 1)):
        calls.clear()
        _logits(model, ids, ReplacementModel(model, saes=SAESet(model, {site: make_sae()}), error=error), edit)
        assert calls == [torch.float16] * want, (error, edit is not None, calls)


@pytest.mark.parametrize(("model_dtype", "module_dtype"),
                         [(torch.float16, torch.float32), (torch.float16, torch.bfloat16),
                          (torch.float16, torch.float64), (torch.float32, torch.float64),
                          (torch.bfloat16, torch.float64)], ids=str)
@pytest.mark.parametrize("kind", ["lorsa", "transcoder", "sae", "clt"])
def test_every_kind_refuses_an_output_past_the_sites_range(kind, model_dtype, module_dtype):
    """The output range check over every replacement kind and every narrowing cast: a decoder bias entry at twice
    the site dtype's max (finite in the module's wider dtype) is a PlacementError naming the site; the model is
    left clean and the same module without that entry splices finite logits."""
    model, hf = tiny_nnsight("llama", dtype=model_dtype)
    cls, key, make = _kinds(tiny_hf_model("llama"), get_adapter(model))[kind]
    module = make().to(module_dtype)
    bias = "b_D" if kind == "lorsa" else "b_dec"
    rset = cls(model, module if key is None else {key: module})
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    got = _logits(model, ids, ReplacementModel(model, **{cls.slot: rset}, error=False))
    assert bool(torch.isfinite(got).all())
    with torch.no_grad():
        getattr(module, bias).view(-1)[3] = 2 * torch.finfo(model_dtype).max
    before = sorted(n for n, _ in hf.named_modules())
    with pytest.raises(PlacementError, match=rf"model\.layers\.\d.*{str(module_dtype)}.*beyond the site's dtype "
                                             rf"{str(model_dtype)}"):
        _logits(model, ids, ReplacementModel(model, **{cls.slot: rset}, error=False))
    assert sorted(n for n, _ in hf.named_modules()) == before


def _weights_at(module, top):
    """``module``'s input and output weights (Lorsa ``W_V``, ``W_O``; the others' ``W_enc``, ``W_dec*``) scaled in
    place to max |W| = ``top`` each."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in ("W_V", "W_O", "W_enc") or name.startswith("W_dec"):
                p.mul_(top / float(p.float().abs().max()))
    return module


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("error", [True, False])
@pytest.mark.parametrize("kind", ["lorsa", "transcoder", "sae", "clt"])
def test_an_fp16_module_overflowing_inside_raises_naming_the_site(kind, error, model_dtype):
    """An fp16 replacement with finite weights (input and output weights at max |W| 30000 < 65504) fed a finite
    input sums past 65504 inside: its output holds inf / NaN. Nothing narrowed a cast, so nothing read it, and the
    model got NaN logits with no word (with ``error=True`` too: ``inf − inf``, where the docs promise the plain
    logits), on an fp16 and an fp32 model alike. It raises PlacementError naming the site, the module and "inf or
    NaN", saying the model's own output there is finite; the model is left clean, and the module before the
    scaling splices finite logits."""
    model, hf = tiny_nnsight("llama", dtype=model_dtype)
    cls, key, make = _kinds(tiny_hf_model("llama"), get_adapter(model))[kind]
    module = make().to(torch.float16)
    rset = cls(model, module if key is None else {key: module})
    ids = torch.randint(2, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    got = _logits(model, ids, ReplacementModel(model, **{cls.slot: rset}, error=error))
    assert bool(torch.isfinite(got).all())
    _weights_at(module, 30000.0)
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    before = sorted(n for n, _ in hf.named_modules())
    with pytest.raises(PlacementError, match=rf"model\.layers\.\d.*{type(module).__name__}.*float16.*inf or NaN.*"
                                             r"own output there is finite"):
        _logits(model, ids, ReplacementModel(model, **{cls.slot: rset}, error=error))
    assert sorted(n for n, _ in hf.named_modules()) == before


@pytest.mark.parametrize("write", ["in place", "assigned fp32"])
@pytest.mark.parametrize("kind", ["lorsa", "transcoder", "sae"])
def test_an_edit_of_an_fp16_modules_internals_past_65504_raises(kind, write):
    """A direct nnsight write into an fp16 replacement's latents (``latents[:] *= 1e7``, or an fp32 tensor of
    values past 65504 assigned in place) is cast to fp16 by nnsight / torch with no range check: inf there, NaN
    logits (with error terms the edit's difference is inf too). The replacement's fp16 output is checked before it
    enters the model: PlacementError naming the site; the same edit by 1e-3 keeps the logits finite. An fp32
    tensor put in the latents' place (``hook.output = t``, not cast) is a ShapeError naming the dtypes (a Lorsa's
    decode raised torch's own "mat1 and mat2 must have the same dtype")."""
    model, _ = tiny_nnsight("llama", dtype=torch.float16)
    cls, key, make = _kinds(tiny_hf_model("llama"), get_adapter(model))[kind]
    module = make().to(torch.float16)
    rset = cls(model, {key: module})
    ids = torch.randint(2, 128, (2, 8), generator=torch.Generator().manual_seed(2))

    def edit(factor):
        def run(sites):
            latents = getattr(sites[cls.slot][key], "hook_z" if kind == "lorsa" else "hook_sae_acts_post").output
            if write == "in place":
                latents[:] *= factor
            else:
                latents[:] = torch.full(latents.shape, factor * 10.0, dtype=torch.float32)
        return run

    for error in (True, False):
        rm = ReplacementModel(model, **{cls.slot: rset}, error=error)
        assert bool(torch.isfinite(_logits(model, ids, rm, edit(1e-3))).all())
        with pytest.raises(PlacementError, match=rf"model\.layers\.\d.*{type(module).__name__}.*inf or NaN"):
            _logits(model, ids, rm, edit(1e7))
        if write == "assigned fp32":
            def swap(sites):
                hook = getattr(sites[cls.slot][key], "hook_z" if kind == "lorsa" else "hook_sae_acts_post")
                hook.output = torch.full(hook.output.shape, 1e7, dtype=torch.float32)

            with pytest.raises(ShapeError, match=r"expects .* dtype torch\.float16, got dtype torch\.float32"):
                _logits(model, ids, rm, swap)


def test_the_overflow_check_reads_fp16_outputs_only(monkeypatch):
    """The inf / NaN check of a replacement's output runs once per site (and once more for a separate clean pass),
    and reads the tensor only when it is fp16: a bf16 / fp32 / fp64 output is not read (on ``meta``, where a read
    raises, it gives False), so bf16 and fp32 modules' no-edit error path still reads nothing at all."""
    from nnsight_lorsa import _placement
    from nnsight_lorsa.envoy import splice_chain

    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        assert _placement.overflowed(torch.full((3,), float("inf"), dtype=dtype, device="meta")) is False
        assert _placement.overflowed(torch.full((3,), float("inf"), dtype=dtype)) is False
    with pytest.raises((RuntimeError, NotImplementedError)):  # fp16: read (a device sync), meta cannot be
        _placement.overflowed(torch.full((3,), float("inf"), dtype=torch.float16, device="meta"))
    assert _placement.overflowed(torch.tensor([1.0, float("nan")], dtype=torch.float16))
    assert not _placement.overflowed(torch.tensor([65504.0], dtype=torch.float16))
    calls = []
    real = splice_chain.overflowed
    monkeypatch.setattr(splice_chain, "overflowed", lambda x: calls.append(x.dtype) or real(x))
    model, _ = tiny_nnsight("gpt2", dtype=torch.float16)
    ids = torch.randint(2, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    site = "transformer.h.1"
    for module_dtype, error in ((torch.float16, True), (torch.float16, False), (torch.float32, True)):
        calls.clear()
        _logits(model, ids, ReplacementModel(model, saes=SAESet(model, {site: make_sae().to(module_dtype)}),
                                             error=error))
        assert calls == [module_dtype], (module_dtype, error, calls)
    calls.clear()
    _logits(model, ids, ReplacementModel(model, saes=SAESet(model, {site: make_sae().to(torch.float16)}), error=True),
            lambda s: s["saes"][site].hook_sae_acts_post.output.mul_(2))
    assert calls == [torch.float16] * 2  # the live output and the clean pass's


def test_an_fp16_module_on_a_model_already_non_finite_says_so():
    """Where the model's own output at the site is not finite either (an fp16 model already non-finite upstream:
    here an embedding row of inf), the error says so and names the remedy for the model, not for the replacement."""
    model, hf = tiny_nnsight("llama", dtype=torch.float16)
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf.model.embed_tokens.weight[int(ids[0, 2])] = float("inf")
    rm = ReplacementModel(model, saes=SAESet(model, {"model.layers.1": make_sae().to(torch.float16)}), error=True)
    with pytest.raises(PlacementError, match=r"model\.layers\.1.*inf or NaN.*own output there is not finite either"
                                             r".*model in a wider dtype"):
        _logits(model, ids, rm)
