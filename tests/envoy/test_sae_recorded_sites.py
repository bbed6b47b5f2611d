"""An SAE whose file records a tensor no module output carries is refused at any key (a helper's probe against
SAELens's ``HookedSAETransformer``, 2026-11-29: a ``hook_resid_mid`` SAE placed at GPT-2's ``ln_2`` — which the
refusal of the file's own site advised — was 1.26 off in the logits, a ``hook_z`` SAE at ``attn.c_proj`` 1.07);
an SAE moved to another module output on purpose is placed where its key says."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sae, tiny_nnsight

from nnsight_lorsa import SAESet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.formats.hook_sites import site_record

_WORLD: dict = {}


def world(family: str):
    if family not in _WORLD:
        model, hf = tiny_nnsight(family)
        _WORLD[family] = (model, hf, get_adapter(model))
    return _WORLD[family]


def output_sites(hf, adapter, layer: int) -> list[str]:
    """Every module of layer ``layer`` whose output has the residual's width, and the layer itself."""
    prefix = adapter.layer_path(layer)
    sites = [prefix]
    for name, _ in hf.get_submodule(prefix).named_modules():
        if name:
            sites.append(f"{prefix}.{name}")
    return sites


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
@pytest.mark.parametrize("hook", ["hook_resid_mid", "hook_mlp_in", "ln2.hook_normalized", "mlp.hook_in",
                                  "attn.hook_z"])
def test_an_sae_of_a_module_input_is_refused_at_every_key(family, hook):
    model, hf, adapter = world(family)
    for via in ("cfg.hook", "saelens"):
        sae = make_sae(seed=1)
        if via == "cfg.hook":
            sae.cfg.hook = f"blocks.1.{hook}"
        else:
            name = f"blocks.1.{hook}"  # as the SAELens reader records it
            sae.cfg.extra = {"saelens": {"hook_name": name, "site": site_record(name, adapter)}}
        for key in output_sites(hf, adapter, 1):
            with pytest.raises(ConfigMismatchError, match="no module output of this model"):
                SAESet(model, {key: sae}, adapter)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_sae_moved_to_another_layer_runs_where_its_key_says(family):
    model, hf, adapter = world(family)
    sae = make_sae(seed=2, hook="blocks.0.hook_resid_post")
    ids = torch.randint(0, 64, (1, 5))
    seen: list = []
    handle = sae.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    want: list = []
    ref = hf.get_submodule(adapter.layer_path(1)).register_forward_hook(
        lambda m, a, out: want.append((out[0] if isinstance(out, tuple) else out).detach().clone()))
    try:
        with torch.no_grad():
            hf(ids)
        with model.trace(ids):
            SAESet(model, {adapter.layer_path(1): sae}, adapter).replace()
    finally:
        handle.remove()
        ref.remove()
    assert len(seen) == 1 and torch.equal(seen[0], want[0])
