"""Modules trained on TransformerLens's centred residual stream, run on the Hugging Face model.

TransformerLens's default weight processing (``center_writing_weights``, LayerNorm models only) makes every write to
the residual stream mean-free over ``d_model``: its ``hook_resid_*`` / ``hook_mlp_out`` / ``hook_attn_out`` tensors
are the Hugging Face model's minus their per-token mean. Llamascopium always trains there; SAELens did until 3.19.2
(and records ``model_from_pretrained_kwargs.center_writing_weights`` since; its ``gpt2-small-res-jb`` release sets it
through ``config_overrides``). Each reference here is plain torch on the Hugging Face model with forward hooks: the
module as its file has it, fed ``x − mean(x)``; the package folds the centring into the encoder
(``formats.hook_sites.centre_residual_input_``) and must compute the same features and logits.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import generated, make_clt, make_lorsa, make_sae, make_transcoder, random_ids, tiny_nnsight, unembed
from hypothesis import strategies as st

from nnsight_lorsa import SAESet, TranscoderSet, get_adapter, load, save
from nnsight_lorsa.errors import CheckpointError, UnsupportedArchitectureError
from nnsight_lorsa.formats import hook_sites
from nnsight_lorsa.formats.hook_sites import sae_site_path
from nnsight_lorsa.formats.saelens import save_saelens

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: relative bound on logits / features against the reference: the fold rounds the encoder once in the weights' dtype
#: (bf16: ReLU SAEs only, whose features are continuous in their pre-activations; a JumpReLU's threshold turns one
#: rounding into a jump, measured to 0.12 of the max logit)
BOUND = {"fp32": 1e-4, "bf16": 3e-2}
LN_FAMILIES = ("gpt2", "neox")
_MODELS: dict = {}


def world(family: str, dt: str = "fp32"):
    if (family, dt) not in _MODELS:
        model, hf = tiny_nnsight(family, dtype=DTYPES[dt])
        _MODELS[family, dt] = (model, hf, get_adapter(model))
    return _MODELS[family, dt]


def blocks(hf) -> torch.nn.ModuleList:
    for path in ("model.layers", "transformer.h", "gpt_neox.layers"):
        try:
            return hf.get_submodule(path)
        except AttributeError:
            continue
    raise AssertionError(type(hf).__name__)


def centred(x: torch.Tensor) -> torch.Tensor:
    """``x`` minus its mean over the last axis (the mean taken in at least fp32)."""
    return x - x.to(torch.promote_types(x.dtype, torch.float32)).mean(-1, keepdim=True).to(x.dtype)


def record(source: str, hook_in: str, hook_out: str | None = None) -> dict:
    """``cfg.extra`` as each loader leaves it."""
    if source == "llamascopium":
        return {"llamascopium": {"hook_point_in": hook_in, "hook_point_out": hook_out or hook_in}}
    rec = {"hook_name": hook_in, "center_writing_weights": {"saelens_centred": True, "saelens": False,
                                                             "saelens_unsaid": None}[source]}
    if hook_out is not None:
        rec["hook_name_out"] = hook_out
    return {"saelens": rec}


@torch.no_grad()
def reference_sae(hf, hook: str, layer: int, sae, centre: bool, ids):
    """Logits with ``sae`` (the file's weights) replacing TransformerLens's ``blocks.layer.hook`` tensor, fed that
    tensor minus its mean where ``centre``; and the features it computed."""
    block = blocks(hf)[layer]
    feats: list = []

    def run(x):
        inp = centred(x) if centre else x
        feats.append(sae.encode(inp))
        return sae(inp)

    if hook == "hook_resid_pre":
        handle = block.register_forward_pre_hook(
            lambda m, args, kwargs: ((run(args[0]), *args[1:]), kwargs) if args else
            (args, {**kwargs, "hidden_states": run(kwargs["hidden_states"])}), with_kwargs=True)
    else:
        module = block if hook == "hook_resid_post" else block.mlp
        handle = module.register_forward_hook(
            lambda m, a, out: (run(out[0]), *out[1:]) if isinstance(out, tuple) else run(out))
    try:
        logits = hf(ids).logits
    finally:
        handle.remove()
    return logits, feats[0]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


@generated(10, 300, family=st.sampled_from(LN_FAMILIES + ("llama",)), dt=st.sampled_from(tuple(DTYPES)),
           hook=st.sampled_from(("hook_resid_pre", "hook_resid_post", "hook_mlp_out")), layer=st.integers(0, 1),
           source=st.sampled_from(("llamascopium", "saelens_centred", "saelens")), b_dec_in=st.booleans(),
           jumprelu=st.booleans(), seed=st.integers(0, 2**16))
def test_an_sae_trained_on_the_centred_residual_computes_what_it_computed_there(family, dt, hook, layer, source,
                                                                                 b_dec_in, jumprelu, seed):
    """Features and logits against the file's SAE fed TransformerLens's tensor (the model's minus its mean on
    LayerNorm families: Llamascopium, SAELens with center_writing_weights), by hand; other modules and RMSNorm
    families read the model's tensor unchanged, bit for bit."""
    model, hf, adapter = world(family, dt)
    name = f"blocks.{layer}.{hook}"
    activation = "jumprelu" if jumprelu and dt == "fp32" else "relu"
    sae = make_sae(seed=seed % 5, hook=name, apply_b_dec_to_input=b_dec_in, activation=activation,
                   extra=record(source, name)).to(DTYPES[dt])
    with torch.no_grad():
        sae.b_dec.add_(0.5)  # a b_dec with a mean: the shift the fold moves into b_enc
    original = copy.deepcopy(sae)
    centre = family in LN_FAMILIES and source != "saelens"
    ids = random_ids(batch=2, seq=6, seed=seed)
    want, want_feats = reference_sae(hf, hook, layer, original, centre, ids)
    path = sae_site_path(sae, adapter)
    saes = SAESet(model, {path: sae}, adapter)
    with torch.no_grad(), model.trace(ids):
        feats, _ = saes.latents_and_output(saes.replace(path))
        feats = feats.save()
        logits = unembed(model).output.save()
    if not centre:
        assert all(torch.equal(a, b) for a, b in zip(sae.state_dict().values(), original.state_dict().values(),
                                                      strict=True))
        assert torch.equal(logits, want), (family, dt, hook, source)
        assert torch.equal(feats, want_feats)
        return
    bound = BOUND[dt]
    assert relative(logits, want) < bound, (family, dt, hook, source, relative(logits, want))
    assert relative(feats, want_feats) < bound, (family, dt, hook, source, relative(feats, want_feats))


def test_the_fold_is_needed_the_unfolded_sae_is_far_off():
    """The reference above tells the two readings apart: the file's SAE fed the model's own residual is far from
    it fed the centred one (the test above would fail without the fold)."""
    model, hf, adapter = world("gpt2")
    name = "blocks.1.hook_resid_post"
    sae = make_sae(seed=1, hook=name, extra=record("saelens_centred", name))
    ids = random_ids(batch=2, seq=6, seed=1)
    right, _ = reference_sae(hf, "hook_resid_post", 1, sae, True, ids)
    wrong, _ = reference_sae(hf, "hook_resid_post", 1, sae, False, ids)
    assert relative(wrong, right) > 100 * BOUND["fp32"]


@generated(10, 300, kind=st.sampled_from(("sae", "sae_b_dec", "transcoder", "skip_transcoder", "clt", "clt_skip")),
           dt=st.sampled_from(("fp32", "fp64", "bf16")), seed=st.integers(0, 2**16))
def test_the_centring_fold_reads_x_as_the_file_reads_x_minus_its_mean(kind, dt, seed):
    """``_centre_encoder_``: features and output of the folded module on ``x`` equal the file's on ``x − mean(x)``
    (every kind's encoder, a skip path, an SAE's ``b_dec`` subtracted first); folding twice changes nothing."""
    if kind.startswith("clt") and dt == "bf16":
        dt = "fp32"  # a CLT is JumpReLU here: a bf16 rounding moves pre-activations across its thresholds
    dtype = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}[dt]
    if kind.startswith("clt"):
        module = make_clt(n_layers=3, skip=kind == "clt_skip", seed=seed % 7)
    elif kind.startswith("sae"):
        module = make_sae(seed=seed % 7, apply_b_dec_to_input=kind == "sae_b_dec", activation="relu")
    else:
        module = make_transcoder(skip=kind == "skip_transcoder", seed=seed % 7, activation="relu",
                                 activation_params={})
    with torch.no_grad():
        module.b_dec.add_(0.3)
    module = module.to(dtype)
    original = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed)
    shape = (3, 5, module.cfg.d_in) if kind.startswith("clt") else (5, module.cfg.d_in)
    x = (torch.randn(shape, generator=g) + 2 * torch.rand(shape[:-1] + (1,), generator=g)).to(dtype)
    hook_sites._centre_encoder_(module)
    once = copy.deepcopy(module.state_dict())
    hook_sites._centre_encoder_(module)
    tol = {"fp32": 1e-5, "fp64": 1e-12, "bf16": 5e-2}[dt]
    for name, value in module.state_dict().items():
        assert relative(value, once[name]) <= (0 if dt == "fp64" else tol) or torch.equal(value, once[name]), name
    with torch.no_grad():
        if kind.startswith("clt"):
            want, got = original.encode(centred(x)), module.encode(x)
            assert relative(got, want) < tol
            assert relative(module.decode(got, x), original.decode(want, centred(x))) < tol
        else:
            assert relative(module.encode(x), original.encode(centred(x))) < tol
            assert relative(module(x), original(centred(x))) < tol


@pytest.mark.parametrize("family", LN_FAMILIES + ("llama",))
def test_a_transcoder_trained_on_the_centred_residual_replaces_the_mlp_as_it_did_there(family):
    """A Llamascopium skip transcoder (``hook_resid_mid`` / ``hook_mlp_in`` -> ``hook_mlp_out``): the file's weights
    fed the residual the pre-MLP norm reads, minus its mean on LayerNorm families, replacing the MLP's output."""
    model, hf, adapter = world(family)
    hook_in = "hook_mlp_in" if family == "neox" else "hook_resid_mid"
    tc = make_transcoder(skip=True, seed=2, extra=record("llamascopium", f"blocks.1.{hook_in}",
                                                         "blocks.1.hook_mlp_out"))
    original = copy.deepcopy(tc)
    block = blocks(hf)[1]
    norm = {"gpt2": "ln_2", "neox": "post_attention_layernorm", "llama": "post_attention_layernorm"}[family]
    seen: list = []
    h1 = getattr(block, norm).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    h2 = block.mlp.register_forward_hook(
        lambda m, a, out: original(centred(seen[-1]) if family != "llama" else seen[-1]))
    ids = random_ids(batch=2, seq=6, seed=4)
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        h1.remove()
        h2.remove()
    tcs = TranscoderSet(model, {1: tc}, adapter)
    with torch.no_grad(), model.trace(ids):
        tcs.replace(layer=1)
        logits = unembed(model).output.save()
    assert relative(logits, want) < BOUND["fp32"], family


@pytest.mark.parametrize("family", LN_FAMILIES + ("llama",))
def test_a_saelens_file_that_does_not_say_which_residual_is_refused_on_layernorm_families(family):
    """No ``center_writing_weights`` and no training version (the pre-SAELens-3 ``gpt2-small-res-jb`` folders, or
    a file of other code): a named error naming the hook and the recipe on GPT-2 / NeoX, the module unchanged;
    RMSNorm models (TransformerLens centres nothing there) run it."""
    model, hf, adapter = world(family)
    name = "blocks.1.hook_resid_post"
    sae = make_sae(hook=name, extra=record("saelens_unsaid", name))
    before = copy.deepcopy(sae.state_dict())
    path = sae_site_path(sae, adapter)
    if family in LN_FAMILIES:
        with pytest.raises(CheckpointError, match=rf"{family}.*{name}.*config_overrides"):
            SAESet(model, {path: sae}, adapter)
        assert all(torch.equal(v, before[k]) for k, v in sae.state_dict().items())
    else:
        SAESet(model, {path: sae}, adapter)


def test_an_sae_rescaling_each_input_by_its_norm_is_refused_on_the_centred_residual():
    model, hf, adapter = world("gpt2")
    name = "blocks.1.hook_resid_post"
    sae = make_sae(hook=name, normalize_activations="constant_norm_rescale", extra=record("saelens_centred", name))
    before = copy.deepcopy(sae.state_dict())
    with pytest.raises(UnsupportedArchitectureError, match="constant_norm_rescale"):
        SAESet(model, {sae_site_path(sae, adapter): sae}, adapter)
    assert all(torch.equal(v, before[k]) for k, v in sae.state_dict().items())


def test_a_refused_transcoder_is_left_as_it_was():
    """A hook refusal comes before the fold: the module a caller passed is not half-changed."""
    model, hf, adapter = world("gpt2")
    tc = make_transcoder(extra=record("llamascopium", "blocks.1.hook_resid_mid", "blocks.1.hook_resid_post"))
    before = copy.deepcopy(tc.state_dict())
    with pytest.raises(UnsupportedArchitectureError):
        TranscoderSet(model, {1: tc}, adapter)
    assert all(torch.equal(v, before[k]) for k, v in tc.state_dict().items())


def _write_cfg(tmp_path, edit) -> object:
    save_saelens(make_sae(activation="relu"), tmp_path / "s", hook_name="blocks.1.hook_resid_post")
    cfg_path = tmp_path / "s" / "cfg.json"
    raw = json.loads(cfg_path.read_text())
    (tmp_path / "s" / "checksums.json").unlink(missing_ok=True)
    raw = edit(raw)
    cfg_path.write_text(json.dumps(raw))
    return tmp_path / "s"


def _pre6(raw: dict) -> dict:
    """The layout of a pre-6.0 file (flat keys, ``hook_point``), as the ``jbloom/GPT2-Small-SAEs-Reformatted``
    folders have it: no architecture, no metadata, no version."""
    return {"d_in": raw["d_in"], "d_sae": raw["d_sae"], "hook_point": raw["metadata"]["hook_name"],
            "hook_point_layer": 1, "model_name": "gpt2-small", "dtype": "torch.float32", "activation_fn": "relu"}


@pytest.mark.parametrize(("edit", "want"), [
    (lambda r: r, False),  # ours: recorded false
    (lambda r: {**r, "metadata": {**r["metadata"], "model_from_pretrained_kwargs": {"center_writing_weights": True}}},
     True),
    (lambda r: {**r, "metadata": {k: v for k, v in r["metadata"].items() if k != "model_from_pretrained_kwargs"}},
     None),
    (lambda r: {**r, "metadata": {"hook_name": r["metadata"]["hook_name"], "sae_lens_training_version": "3.18.0",
                                  "model_from_pretrained_kwargs": {}}}, True),  # TransformerLens defaults then
    (lambda r: {**r, "metadata": {"hook_name": r["metadata"]["hook_name"], "sae_lens_training_version": "3.19.2",
                                  "model_from_pretrained_kwargs": {}}}, False),  # no processing since
    (lambda r: {**r, "metadata": {"hook_name": r["metadata"]["hook_name"], "sae_lens_training_version": "6.54.12",
                                  "model_class_name": "AutoModelForCausalLM"}}, False),
    (lambda r: _pre6(r), None),
    (lambda r: {**_pre6(r), "model_from_pretrained_kwargs": {"center_writing_weights": True}}, True),  # a release
    (lambda r: {**_pre6(r), "sae_lens_training_version": "2.1.3"}, True),
])
def test_the_saelens_reader_records_which_residual_the_file_says(tmp_path, edit, want):
    """``center_writing_weights`` from ``model_from_pretrained_kwargs`` (in metadata, or flat in a pre-6.0 file or
    a release's ``config_overrides``), else the training version (SAELens trained with TransformerLens's default
    processing before 3.19.2), else unknown; the pre-6.0 ``hook_point`` is the hook name."""
    sae = load(_write_cfg(tmp_path, edit))
    assert sae.cfg.extra["saelens"]["center_writing_weights"] is want
    assert sae.cfg.extra["saelens"]["hook_name"] == "blocks.1.hook_resid_post"
    assert hook_sites.trained_centred(sae) is want


@pytest.mark.parametrize("bad", [{"center_writing_weights": "yes"}, ["center_writing_weights"]])
def test_a_malformed_model_from_pretrained_kwargs_is_a_named_error(tmp_path, bad):
    with pytest.raises(CheckpointError, match="model_from_pretrained_kwargs"):
        load(_write_cfg(tmp_path, lambda r: {**r, "metadata": {**r["metadata"], "model_from_pretrained_kwargs": bad}}))


def test_a_pre6_file_loads_with_the_override_a_release_gives(tmp_path):
    """``config_overrides`` (how ``load(release, sae_id)`` passes ``gpt2-small-res-jb``'s) decides an unsaid file;
    the loaded SAE then runs on GPT-2 centred."""
    folder = _write_cfg(tmp_path, _pre6)
    sae = load(folder, config_overrides={"model_from_pretrained_kwargs": {"center_writing_weights": True}})
    assert hook_sites.trained_centred(sae) is True
    model, hf, adapter = world("gpt2")
    assert hook_sites.centre_residual_input_(sae, adapter, hf) is True


def test_save_saelens_says_which_residual_and_round_trips(tmp_path):
    """Ours are written ``center_writing_weights: false`` and attach unchanged on GPT-2; a centred file's module
    keeps ``true``."""
    model, hf, adapter = world("gpt2")
    ours = make_sae(hook="blocks.1.hook_resid_post")
    save_saelens(ours, tmp_path / "ours", hook_name="blocks.1.hook_resid_post")
    raw = json.loads((tmp_path / "ours" / "cfg.json").read_text())
    assert raw["metadata"]["model_from_pretrained_kwargs"] == {"center_writing_weights": False}
    back = load(tmp_path / "ours")
    assert hook_sites.centre_residual_input_(back, adapter, hf) is False
    theirs = make_sae(hook="blocks.1.hook_resid_post", extra=record("saelens_centred", "blocks.1.hook_resid_post"))
    save_saelens(theirs, tmp_path / "theirs", hook_name="blocks.1.hook_resid_post")
    assert hook_sites.trained_centred(load(tmp_path / "theirs")) is True


def test_a_llamascopium_lorsa_file_says_whether_it_was_trained_centred(tmp_path):
    """Their Lorsa files were (their TransformerLens backend); ours say false in the header (with or without the
    norm fold of ``model=``): ``evaluate`` then measures FVU against the attention output as it is."""
    from safetensors.torch import load_file, save_file

    model, hf, adapter = world("gpt2")
    lorsa = make_lorsa(hf, adapter, 1)
    assert hook_sites.trained_centred(lorsa) is False
    for kw in ({}, {"model": model}):
        save(lorsa, tmp_path / "l", format="llamascopium", **kw)
        back = load(tmp_path / "l")
        assert hook_sites.trained_centred(back) is False and not hook_sites.writes_centred(back, adapter, hf)
        weights = tmp_path / "l" / "sae_weights.safetensors"
        save_file(load_file(weights), weights, metadata={"format": "pt"})  # their file: no header of ours
        (tmp_path / "l" / "checksums.json").unlink(missing_ok=True)
        theirs = load(tmp_path / "l")
        assert hook_sites.trained_centred(theirs) is True and hook_sites.writes_centred(theirs, adapter, hf)


def test_evaluate_measures_a_centred_saes_fvu_against_the_centred_residual():
    """FVU of an SAE trained on TransformerLens's residual: ``‖(x − mean x) − x̂‖² / Σ‖(x − mean x) − its mean‖²``
    over the kept positions, by hand from the reference hooks (the model's own ``x`` would count the mean as
    error)."""
    from nnsight_lorsa.training import TokenDataset, evaluate

    model, hf, adapter = world("gpt2")
    name = "blocks.1.hook_resid_post"
    sae = make_sae(seed=3, hook=name, extra=record("llamascopium", name))
    original = copy.deepcopy(sae)
    ids = random_ids(batch=4, seq=8, seed=5)
    path = sae_site_path(sae, adapter)
    ev = evaluate(SAESet(model, {path: sae}, adapter), TokenDataset(ids), at=path, batch_size=4)
    seen: list = []
    handle = blocks(hf)[1].register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple)
                                                                               else out))
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        handle.remove()
    x = centred(seen[0][:, 1:]).flatten(0, 1).double()  # BOS (column 0) is not counted
    with torch.no_grad():
        recon = original(x.float()).double()
    fvu = float((x - recon).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    assert ev.fvu == pytest.approx(fvu, rel=1e-4)


def test_a_release_like_gpt2_small_res_jb_is_read_as_centred(tmp_path):
    """``gpt2-small-res-jb``'s registry entry (SAELens ``pretrained_saes.yaml``) gives its pre-6.0 folders
    ``config_overrides: {model_from_pretrained_kwargs: {center_writing_weights: true}}``; loaded by release, the
    record says so (it was silently false: the flat override was not read) and the legacy ``hook_point`` is the
    hook."""
    import shutil
    from pathlib import Path

    peers = Path(__file__).resolve().parent.parent / "fixtures" / "peers" / "saelens"
    repo = tmp_path / "GPT2-Small-SAEs-Reformatted"
    shutil.copytree(peers / "legacy_relu_scaling_factor_ones", repo / "blocks.1.hook_resid_post")
    registry = tmp_path / "pretrained_saes.yaml"
    registry.write_text(
        "gpt2-small-res-jb:\n  conversion_func: null\n  model: gpt2-small\n"
        f"  repo_id: {repo}\n"
        "  config_overrides:\n    model_from_pretrained_kwargs:\n      center_writing_weights: true\n"
        "  saes:\n  - id: blocks.1.hook_resid_post\n    path: blocks.1.hook_resid_post\n")
    sae = load("gpt2-small-res-jb", "blocks.1.hook_resid_post", release_registry=registry)
    assert hook_sites.trained_centred(sae) is True
    assert sae.cfg.extra["saelens"]["hook_name"] == "blocks.1.hook_resid_post"
    assert hook_sites.trained_centred(load(repo / "blocks.1.hook_resid_post")) is None  # by path: unsaid


@pytest.mark.parametrize("family", LN_FAMILIES)
def test_stacked_centred_saes_each_read_the_centred_residual_at_their_site(family):
    """Several such SAEs at once (``error=False``): each reads the residual at its site minus its mean — what it was
    trained on — whatever the reconstructions spliced before it added. (TransformerLens's own stacked splice feeds a
    later module its residual with the earlier reconstructions' means in it, which its training data never held;
    the two agree where those reconstructions are mean-free, and with ``error=True``, where every site's tensor is
    the model's own: docs/formats.md.)"""
    model, hf, adapter = world(family)
    saes, originals, handles = {}, [], []
    for layer in range(2):
        name = f"blocks.{layer}.hook_resid_post"
        sae = make_sae(seed=layer, hook=name, activation="relu", extra=record("llamascopium", name))
        with torch.no_grad():
            sae.b_dec.add_(0.5)  # reconstructions with a mean: the case where the two readings differ
        originals.append(copy.deepcopy(sae))
        saes[sae_site_path(sae, adapter)] = sae
        handles.append(blocks(hf)[layer].register_forward_hook(
            lambda m, a, out, s=originals[-1]: (s(centred(out[0])), *out[1:]) if isinstance(out, tuple)
            else s(centred(out))))
    ids = random_ids(batch=2, seq=6, seed=7)
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        for h in handles:
            h.remove()
    sae_set = SAESet(model, saes, adapter)
    with torch.no_grad(), model.trace(ids):
        for path in saes:
            sae_set.replace(path)
        logits = unembed(model).output.save()
    assert relative(logits, want) < BOUND["fp32"], relative(logits, want)
