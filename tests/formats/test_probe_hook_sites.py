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

import pytest
import torch
from helpers import FAMILIES, generated, make_sae, random_ids, tiny_nnsight, unembed
from hypothesis import strategies as st

from nnsight_lorsa import SAESet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, UnsupportedArchitectureError
from nnsight_lorsa.formats.hook_sites import sae_site_path, transformer_lens_hook_site

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: hooks whose tensor is a module output somewhere in every family: an SAESet places them
SAE_HOOKS = ("hook_resid_pre", "hook_resid_post", "hook_mlp_out")
#: hooks that are a module's input (or no module boundary): an SAE there is refused by name
INPUT_HOOKS = ("hook_resid_mid", "hook_mlp_in", "ln2.hook_normalized", "mlp.hook_in")
#: hooks the package has no site for
UNMAPPED_HOOKS = ("hook_attn_out", "attn.hook_z", "mlp.hook_post", "hook_attn_in", "ln1.hook_normalized")

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
