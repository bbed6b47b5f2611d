"""Hook-site probe: where a loaded SAE / transcoder reads and writes, per family, hook name and dtype.

Each TransformerLens / SAELens / circuit-tracer hook name the package accepts is placed the way the loaders place
it (:func:`~nnsight_lorsa.formats.hook_sites.sae_site_path` for an SAE's ``cfg.hook``,
:func:`~nnsight_lorsa.formats.hook_sites.mlp_site_io` for a transcoder's circuit-tracer hooks), and compared with a
plain-torch reference that takes the tensor the name means by TransformerLens's definition (``components/
transformer_block.py``: ``resid_pre`` the block's input; ``resid_post`` its output; ``hook_mlp_out`` after Gemma-2's
``ln2_post``; ``hook_mlp_in`` / ``hook_resid_mid`` the residual BEFORE ``ln2``; ``ln2.hook_normalized`` the
normalised residual before the gain) with forward (pre-)hooks on the Hugging Face modules, named here without the
adapters: (1) the module placed by the package receives exactly that tensor (bit for bit) and (2) the logits equal
the same replacement done by hand. Names without a site are named errors naming the hook.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from helpers import FAMILIES, generated, make_sae, make_transcoder, random_ids, tiny_nnsight, unembed
from hypothesis import strategies as st

from nnsight_lorsa import SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, UnsupportedArchitectureError
from nnsight_lorsa.formats.hook_sites import sae_site_path, transformer_lens_hook_site

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: hooks whose tensor is a module output somewhere in every family: an SAESet places them
SAE_HOOKS = ("hook_resid_pre", "hook_resid_post", "hook_mlp_out", "hook_attn_out")
#: hooks that are a module's input (or no module boundary): an SAE there is refused by name
INPUT_HOOKS = ("hook_resid_mid", "hook_mlp_in", "ln2.hook_normalized", "mlp.hook_in")
#: hooks the package has no site for
UNMAPPED_HOOKS = ("attn.hook_z", "mlp.hook_post", "hook_attn_in", "ln1.hook_normalized")

_MODELS: dict = {}


def world(family: str, dt: str):
    key = (family, dt)
    if key not in _MODELS:
        model, hf = tiny_nnsight(family, dtype=DTYPES[dt])
        _MODELS[key] = (model, hf, get_adapter(model))
    return _MODELS[key]


def blocks(hf) -> torch.nn.ModuleList:
    """The decoder layers, named per family here (not through the adapters)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers"):
        with contextlib.suppress(AttributeError):
            return hf.get_submodule(path)
    raise AssertionError(type(hf).__name__)


def reference_hook(hf, hook: str, layer: int, replace=None, seen=None):
    """A handle placing ``replace`` (or a recorder) at the tensor TransformerLens's ``blocks.layer.hook`` names."""
    block = blocks(hf)[layer]

    def swap(x):
        if seen is not None:
            seen.append(x.detach().clone())
        return x if replace is None else replace(x)

    if hook == "hook_resid_pre":  # the block's input hidden states
        def pre(module, args, kwargs):
            if args:
                return (swap(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": swap(kwargs["hidden_states"])}
        return block.register_forward_pre_hook(pre, with_kwargs=True)
    if hook == "hook_resid_post":
        module = block
    elif hook == "hook_mlp_out":  # after Gemma-2/3's (and OLMo-2's) post-MLP norm: what is added to the residual
        module = getattr(block, "post_feedforward_layernorm", None) or block.mlp
    elif hook == "hook_attn_out":  # after their post-attention norm (Llama's post_attention_layernorm is pre-MLP)
        module = (block.post_attention_layernorm if hasattr(block, "post_feedforward_layernorm")
                  else attention_of(block))
    else:
        raise AssertionError(hook)

    def post(module, args, output):
        if isinstance(output, tuple):
            return (swap(output[0]), *output[1:])
        return swap(output)
    return module.register_forward_hook(post)


@torch.no_grad()
def run_reference(hf, hook, layer, ids, replace=None, seen=None):
    handle = reference_hook(hf, hook, layer, replace, seen)
    logits: list = []
    head = hf.get_output_embeddings().register_forward_hook(lambda m, a, out: logits.append(out))
    try:
        hf(ids)
    finally:
        handle.remove()
        head.remove()
    return logits[0]


@generated(12, 400, family=st.sampled_from(FAMILIES), dt=st.sampled_from(tuple(DTYPES)),
           hook=st.sampled_from(SAE_HOOKS), layer=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_an_sae_placed_by_its_hook_name_reads_and_replaces_that_tensor(family, dt, hook, layer, seed):
    check_sae_site(family, dt, hook, layer, seed)


@pytest.mark.parametrize(("family", "hook", "layer"), [
    ("gpt2", "hook_resid_pre", 0),  # wte + wpe, not wte alone (was: transformer.wte)
    ("gpt_neox", "hook_resid_pre", 0),
    ("gemma2", "hook_mlp_out", 1),  # after post_feedforward_layernorm (was: the MLP's raw output)
    ("gemma3", "hook_mlp_out", 0),
    ("olmo2", "hook_mlp_out", 1),
    ("gemma2", "hook_attn_out", 1),  # after post_attention_layernorm (was: refused, no site mapping)
    ("olmo2", "hook_attn_out", 0),
    ("gpt2", "hook_attn_out", 1),  # the attention's output, c_proj's bias included
    ("neox", "hook_attn_out", 0),  # a parallel residual: the attention's output all the same
])
@pytest.mark.parametrize("dt", tuple(DTYPES))
def test_the_sites_that_were_one_module_off(family, hook, layer, dt):
    check_sae_site("neox" if family == "gpt_neox" else family, dt, hook, layer, 3)


@torch.no_grad()
def check_sae_site(family, dt, hook, layer, seed):
    model, hf, adapter = world(family, dt)
    layer = min(layer, adapter.n_layers - 1)
    sae = make_sae(seed=seed % 7, hook=f"blocks.{layer}.{hook}").to(DTYPES[dt])
    path = sae_site_path(sae, adapter)
    ids = random_ids(batch=2, seq=6, seed=seed)
    want_in: list = []
    want = run_reference(hf, hook, layer, ids, replace=sae, seen=want_in)
    got_in: list = []
    handle = sae.register_forward_pre_hook(lambda m, args: got_in.append(args[0].detach().clone()))
    try:
        with model.trace(ids):
            SAESet(model, {path: sae}, adapter).replace(path)
            logits = unembed(model).output.save()
    finally:
        handle.remove()
    assert len(got_in) == 1 and got_in[0].dtype == want_in[0].dtype, (family, hook, path)
    assert torch.equal(got_in[0], want_in[0]), (family, dt, hook, layer, path)
    assert torch.equal(logits, want), (family, dt, hook, layer, path, (logits - want).abs().max())


@pytest.mark.parametrize("hook", INPUT_HOOKS + UNMAPPED_HOOKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_an_sae_on_a_hook_without_a_module_output_is_a_named_error(family, hook):
    model, hf, adapter = world(family, "fp32")
    sae = make_sae(hook=f"blocks.1.{hook}")
    with pytest.raises((ConfigMismatchError, UnsupportedArchitectureError), match=hook.replace(".", r"\.")
                       if hook in UNMAPPED_HOOKS else "of layer 1"):
        sae_site_path(sae, adapter)


def test_the_hook_table_names_the_unmapped_hook():
    with pytest.raises(UnsupportedArchitectureError, match=r"blocks\.0\.attn\.hook_z"):
        transformer_lens_hook_site("blocks.0.attn.hook_z")


# ------------------------------------------------------------------ transcoders by their circuit-tracer hooks
#: circuit-tracer ``feature_input_hook`` / ``feature_output_hook`` values the package accepts (``hook_mlp_in``: the
#: pre-MLP norm's input in legacy TransformerLens and in TransformerLens 3.9's ``BlockBridge`` alike; until
#: 2026-11-29 read as the MLP's input, one norm late)
TC_INPUT_HOOKS = ("mlp.hook_in", "hook_resid_mid", "ln2.hook_normalized", "hook_mlp_in")
TC_OUTPUT_HOOKS = ("mlp.hook_out", "hook_mlp_out")


def pre_mlp_norm(block) -> torch.nn.Module | None:
    """The norm the MLP reads through; None for OLMo-2 (its norms come after the attention and the MLP)."""
    for name in ("ln_2", "pre_feedforward_layernorm"):
        if hasattr(block, name):
            return getattr(block, name)
    return None if hasattr(block, "post_feedforward_layernorm") else block.post_attention_layernorm


def attention_of(block) -> torch.nn.Module:
    for name in ("self_attn", "attn", "attention"):
        if hasattr(block, name):
            return getattr(block, name)
    raise AssertionError(type(block).__name__)


def reference_transcoder_hooks(hf, layer, in_hook, out_hook, transcoder, seen):
    """Handles that record TransformerLens's ``in_hook`` of ``layer`` into ``seen`` (cast to the transcoder's dtype)
    and replace ``out_hook``'s tensor by ``transcoder`` of it: ``resid_mid = resid_pre + attn_out`` (after a
    post-attention norm where the family has post-norms), ``ln2.hook_normalized`` its ``x / rms(x)`` (a LayerNorm's
    ``(x − mean x) / σ(x)``) in fp32."""
    block = blocks(hf)[layer]
    post_norms = hasattr(block, "post_feedforward_layernorm")
    parts: dict = {}
    handles = []

    def resid_pre(module, args, kwargs):
        parts["pre"] = args[0] if args else kwargs["hidden_states"]

    def attn_out(module, args, output):
        parts["attn"] = output[0] if isinstance(output, tuple) else output

    def mlp_in(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if in_hook == "mlp.hook_in":
            value = x
        elif in_hook == "hook_mlp_in" and getattr(hf.config, "use_parallel_residual", False):
            value = parts["pre"]  # TransformerLens: hook_mlp_in(resid_pre) under a parallel residual
        else:  # ln2 reads resid_pre under a parallel residual, resid_mid otherwise
            mid = parts["pre"] if getattr(hf.config, "use_parallel_residual", False) else parts["pre"] + parts["attn"]
            if in_hook == "ln2.hook_normalized":  # before the gain (and bias): x / rms(x), or (x − mean x) / σ(x)
                norm = pre_mlp_norm(block)
                eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
                mid = mid.float()
                if isinstance(norm, torch.nn.LayerNorm):  # TransformerLens's LayerNormPre (it divides by the sqrt)
                    mid = mid - mid.mean(-1, keepdim=True)
                    mid = mid * torch.rsqrt(mid.pow(2).mean(-1, keepdim=True) + eps)
                else:
                    mid = mid * torch.rsqrt(mid.pow(2).mean(-1, keepdim=True) + eps)
            value = mid
        seen.append(value.to(next(transcoder.parameters()).dtype))

    def out(module, args, output):
        return transcoder(seen[-1]).to(output.dtype)

    handles.append(block.register_forward_pre_hook(resid_pre, with_kwargs=True))
    attn_site = block.post_attention_layernorm if post_norms else attention_of(block)
    handles.append(attn_site.register_forward_hook(attn_out))
    handles.append(block.mlp.register_forward_pre_hook(mlp_in, with_kwargs=True))
    out_module = block.post_feedforward_layernorm if post_norms and out_hook == "hook_mlp_out" else block.mlp
    handles.append(out_module.register_forward_hook(out))
    return handles


@generated(12, 400, family=st.sampled_from(FAMILIES), dt=st.sampled_from(tuple(DTYPES)),
           in_hook=st.sampled_from(TC_INPUT_HOOKS), out_hook=st.sampled_from(TC_OUTPUT_HOOKS),
           layer=st.integers(0, 2), skip=st.booleans(), seed=st.integers(0, 2**16),
           source=st.sampled_from(("circuit_tracer", "llamascopium", "saelens")))
def test_a_transcoder_placed_by_its_hooks_reads_and_replaces_those_tensors(family, dt, in_hook, out_hook, layer, skip,
                                                                         seed, source):
    check_transcoder_site(family, dt, in_hook, out_hook, layer, skip, seed, source)


@pytest.mark.parametrize(("family", "in_hook", "out_hook", "source"), [
    ("llama", "hook_resid_mid", "mlp.hook_out", "saelens"),  # the residual before the norm (was: the MLP input)
    ("qwen3", "ln2.hook_normalized", "mlp.hook_out", "saelens"),  # x / rms(x) before the gain (was: after it)
    ("gemma2", "ln2.hook_normalized", "hook_mlp_out", "llamascopium"),  # and after the post-norm
    ("gemma3", "hook_resid_mid", "hook_mlp_out", "llamascopium"),
    ("gemma2", "hook_resid_mid", "hook_mlp_out", "saelens"),
    ("gpt2", "ln2.hook_normalized", "mlp.hook_out", "saelens"),  # (x − mean x) / σ(x) before gain and bias (was:
    ("neox", "ln2.hook_normalized", "mlp.hook_out", "circuit_tracer"),  # refused: "LayerNorm with a gain")
    ("neox", "hook_resid_mid", "mlp.hook_out", "llamascopium"),  # parallel residual: refused by name
    ("llama", "hook_mlp_in", "mlp.hook_out", "saelens"),  # the residual before the norm (was: the MLP input)
    ("neox", "hook_mlp_in", "mlp.hook_out", "saelens"),  # parallel residual: the layer's input
    ("gemma2", "hook_mlp_in", "hook_mlp_out", "circuit_tracer"),
    ("olmo2", "hook_mlp_in", "mlp.hook_out", "llamascopium"),  # no pre-MLP norm: the MLP's input
])
@pytest.mark.parametrize("dt", tuple(DTYPES))
def test_saelens_and_llamascopium_transcoders_run_where_their_hook_names_say(family, in_hook, out_hook, source, dt):
    check_transcoder_site(family, dt, in_hook, out_hook, 1, True, 5, source)


@pytest.mark.parametrize(("extra", "hook"), [
    ({"saelens": {"hook_name": "blocks.1.hook_resid_pre"}}, "hook_resid_pre"),
    ({"llamascopium": {"hook_point_in": "blocks.1.hook_resid_pre", "hook_point_out": "blocks.1.hook_resid_post"}},
     "hook_resid_pre"),
    ({"sparsify": {"hookpoint": "layers.1", "transcode": True}}, "layers.1"),
])
def test_a_transcoder_file_naming_no_mlp_site_is_a_named_error(extra, hook):
    model, hf, adapter = world("llama", "fp32")
    with pytest.raises(UnsupportedArchitectureError, match=rf"llama.*{re.escape(hook)}.*layer 1"):
        TranscoderSet(model, {1: make_transcoder(extra=extra)}, adapter)


def transcoder_extra(source, layer, in_hook, out_hook):
    if source == "circuit_tracer":
        return {"circuit_tracer": {"feature_input_hook": in_hook, "feature_output_hook": out_hook}}
    if source == "llamascopium":
        # not centred: a Llamascopium file of TransformerLens's centred residual on GPT-2 / NeoX reads x − mean(x)
        # (tests/formats/test_centred_residual.py); here the sites alone, as in a file this package wrote
        return {"llamascopium": {"hook_point_in": f"blocks.{layer}.{in_hook}",
                                 "hook_point_out": f"blocks.{layer}.{out_hook}", "center_writing_weights": False}}
    return {"saelens": {"hook_name": f"blocks.{layer}.{in_hook}", "hook_name_out": f"blocks.{layer}.{out_hook}"}}


@torch.no_grad()
def check_transcoder_site(family, dt, in_hook, out_hook, layer, skip, seed, source="circuit_tracer"):
    model, hf, adapter = world(family, dt)
    layer = min(layer, adapter.n_layers - 1)
    extra = transcoder_extra(source, layer, in_hook, out_hook)
    tc = make_transcoder(skip=skip, seed=seed % 5, extra=extra).to(DTYPES[dt])
    block = blocks(hf)[layer]
    refused = ((in_hook == "hook_resid_mid" and getattr(hf.config, "use_parallel_residual", False))
               or (in_hook == "ln2.hook_normalized" and pre_mlp_norm(block) is None))
    if refused:  # no such tensor, or not computable from the norm's input: a named error naming family and hook
        with pytest.raises(UnsupportedArchitectureError, match=rf"{adapter.family}.*{re.escape(in_hook)}"):
            TranscoderSet(model, {layer: tc}, adapter)
        return
    ids = random_ids(batch=2, seq=6, seed=seed)
    want_in: list = []
    handles = reference_transcoder_hooks(hf, layer, in_hook, out_hook, tc, want_in)
    logits: list = []
    handles.append(hf.get_output_embeddings().register_forward_hook(lambda m, a, out: logits.append(out)))
    try:
        hf(ids)
    finally:
        for h in handles:
            h.remove()
    got_in: list = []
    handle = tc.register_forward_pre_hook(lambda m, args: got_in.append(args[0].detach().clone()))
    try:
        with model.trace(ids):
            TranscoderSet(model, {layer: tc}, adapter).replace(layer)
            got = unembed(model).output.save()
    finally:
        handle.remove()
    where = (family, dt, in_hook, out_hook, layer)
    assert len(got_in) == 1 and torch.equal(got_in[0], want_in[0]), (*where, (got_in[0] - want_in[0]).abs().max())
    assert torch.equal(got, logits[0]), (*where, (got - logits[0]).abs().max())


def test_a_saelens_transcoder_file_keeps_its_output_hook(tmp_path):
    """``hook_name_out`` (SAELens ``TranscoderConfig``) read from the file: on Gemma-2 ``hook_mlp_out`` is
    ``post_feedforward_layernorm``'s output, ``hook_resid_mid`` the pre-MLP norm's input."""
    import json

    from nnsight_lorsa.formats.hook_sites import mlp_site_io
    from nnsight_lorsa.formats.saelens import save_saelens

    model, hf, adapter = world("gemma2", "fp32")
    save_saelens(make_transcoder(skip=False, activation="relu", activation_params={}), tmp_path / "tc",
                 hook_name="blocks.1.hook_resid_mid")
    cfg_path = tmp_path / "tc" / "cfg.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["metadata"]["hook_name_out"] = "blocks.1.hook_mlp_out"
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "tc" / "checksums.json").unlink()  # ours, which the edit would fail (a SAELens file has none)
    tcs = TranscoderSet.from_pretrained(model, tmp_path / "tc", adapter=adapter)
    io = mlp_site_io(tcs[1], adapter, hf, 1)
    assert (io.input_path, io.output_path, io.eps) == (
        "model.layers.1.pre_feedforward_layernorm", "model.layers.1.post_feedforward_layernorm", None)


@pytest.mark.parametrize("family", ["gpt2", "neox"])
def test_an_sae_on_the_residual_before_layer_0_runs_first_in_a_replacement_model(family):
    """``blocks.0.hook_resid_pre`` sits on ``adapter.residual_start_path`` (GPT-2 ``transformer.drop``), which the
    replacement model orders before the layers (it was sorted after them all: edits at both ran out of order)."""
    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.envoy.targets import Feature
    from nnsight_lorsa.patching import steer

    model, hf, adapter = world(family, "fp32")
    saes = {sae_site_path(make_sae(seed=i, hook=f"blocks.{i}.hook_resid_pre"), adapter): make_sae(seed=i)
            for i in range(2)}
    assert list(saes)[0] == adapter.residual_start_path
    rm = ReplacementModel(model, saes=SAESet(model, saes, adapter), error=False)
    first, second = (Feature(path, 3) for path in saes)
    assert rm.sort([second, first]) == [first, second]
    ids = random_ids(batch=1, seq=5)
    with torch.no_grad(), model.trace(ids):
        rm.replace()
        logits = unembed(model).output.save()
    with torch.no_grad(), model.trace(ids):
        rm.prepare([second, first])
        for target in rm.sort([second, first]):  # the order the model runs them
            steer(rm(target), 0.0)
        same = unembed(model).output.save()
    assert torch.equal(same, logits)
    handles = [reference_hook(hf, "hook_resid_pre", i, replace=saes[path]) for i, path in enumerate(saes)]
    try:
        want = run_reference(hf, "hook_resid_post", 0, ids)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(logits, want)
