"""A Lorsa from the authors' files runs where their hooks say: TransformerLens's ``ln1.hook_normalized`` in,
``hook_attn_out`` out.

Llamascopium loads the model through TransformerLens with its default processing (``fold_ln``: the pre-attention
norm becomes ``RMSNormPre`` / ``LayerNormPre``, its gain and bias folded into ``W_Q``, ``W_K``, ``W_V``), so a Lorsa
whose ``hook_point_in`` is ``blocks.L.ln1.hook_normalized`` was trained on the norm *before* its gain and bias;
the attention module of the Hugging Face model reads the norm's output, after them. ``LorsaSet.from_pretrained``
spliced such a Lorsa at the attention's input as it came: the gain applied twice, no error. The reference here is
the file's Lorsa (``load``, unfolded) fed ``x̂`` computed from the norm's input as TransformerLens computes it, its
output put in place of the attention module's output by plain forward hooks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_lorsa, random_ids, tiny_nnsight, unembed

from nnsight_lorsa import LorsaSet, get_adapter, load, save
from nnsight_lorsa.errors import ConfigMismatchError, UnsupportedArchitectureError

LAYER = 1


def _their_lorsa(hf, adapter, layer: int = LAYER, hook_in: str = "ln1.hook_normalized",
                 hook_out: str = "hook_attn_out", in_layer: int | None = None):
    """A Lorsa carrying the record of a Llamascopium file (its hooks, no site mark)."""
    lorsa = make_lorsa(hf, adapter, layer, seed=3)
    lorsa.cfg.extra = {"llamascopium": {"hook_point_in": f"blocks.{layer if in_layer is None else in_layer}.{hook_in}",
                                        "hook_point_out": f"blocks.{layer}.{hook_out}"}}
    return lorsa


def _norm_with_gain(hf, adapter, layer: int = LAYER, seed: int = 0) -> torch.nn.Module:
    """The layer's pre-attention norm, its gain drawn in [0.3, 2] (and its bias, if it has one, nonzero)."""
    norm = hf.get_submodule(adapter.attention_norm_path(layer))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = norm.weight
        gain = torch.rand(weight.shape, generator=g) * 1.7 + 0.3
        weight.copy_(gain - 1 if type(norm).__name__ == "GemmaRMSNorm" else gain)  # Gemma's gain is 1 + weight
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=g) * 0.2)
    return norm


def _normalized(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """TransformerLens's ``ln1.hook_normalized``: ``RMSNormPre`` ``x / sqrt(mean(x²) + eps)`` or ``LayerNormPre``
    ``(x − mean) / sqrt(var + eps)``, in fp32."""
    x = x.float()
    if isinstance(norm, torch.nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
        return x / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _reference_logits(hf, adapter, lorsa, norm, ids: torch.Tensor) -> torch.Tensor:
    seen: dict = {}
    attention = hf.get_submodule(adapter.attention_path(LAYER))

    def take(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    def swap(module, args, output):
        out = lorsa(_normalized(norm, seen["x"]).to(lorsa.W_Q.dtype), torch.arange(ids.shape[1]))
        return (out.to(output[0].dtype), *output[1:]) if isinstance(output, tuple) else out.to(output.dtype)

    handles = [norm.register_forward_pre_hook(take, with_kwargs=True), attention.register_forward_hook(swap)]
    try:
        with torch.no_grad():
            return hf(ids).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "phi3", "gpt2", "neox"])
def test_a_llamascopium_lorsa_computes_on_the_attention_input_what_it_computed_on_ln1_hook_normalized(
        family, tmp_path):
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    norm = _norm_with_gain(hf, adapter)
    save(_their_lorsa(hf, adapter), tmp_path / "theirs", format="llamascopium")
    theirs = load(tmp_path / "theirs")  # the file's Lorsa, as Llamascopium runs it (on x̂)
    ids = random_ids(2, 9, seed=4)
    want = _reference_logits(hf, adapter, theirs, norm, ids)
    lorsas = LorsaSet.from_pretrained(model, tmp_path / "theirs")
    with torch.no_grad(), model.trace(ids):
        lorsas.replace(layer=LAYER)
        got = unembed(model).output.save()
    with torch.no_grad(), model.trace(ids):
        plain = unembed(model).output.save()
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2e-5 * scale, family
    assert float((plain - want).abs().max()) > 1e-2 * scale  # the Lorsa changes the logits: the test compares them
    # the gain applied twice, as before: not what the file computes
    with torch.no_grad(), model.trace(ids):
        LorsaSet(model, {LAYER: _fold_undone(load(tmp_path / "theirs"))}).replace(layer=LAYER)
        twice = unembed(model).output.save()
    assert float((twice - want).abs().max()) > 1e-3 * scale
    # saved again, it says it reads the attention's input: loaded back, it is not folded a second time
    lorsas.save(tmp_path / "ours")
    save(lorsas[LAYER], tmp_path / "ours_llamascopium", format="llamascopium")
    for again in (LorsaSet.from_pretrained(model, tmp_path / "ours"),
                  LorsaSet.from_pretrained(model, tmp_path / "ours_llamascopium")):
        with torch.no_grad(), model.trace(ids):
            again.replace(layer=LAYER)
            same = unembed(model).output.save()
        assert float((same - got).abs().max()) <= 1e-6 * scale


def _fold_undone(lorsa):
    """The file's Lorsa marked as reading the attention input without the fold (what the splice did before)."""
    lorsa.cfg.extra["llamascopium"]["site"] = "attention"
    return lorsa


def test_a_lorsa_of_this_package_round_trips_through_llamascopium_files_unchanged(tmp_path):
    """Our Lorsas read the attention's input: the file says so in its header, and the set does not fold it."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    _norm_with_gain(hf, adapter)
    ours = make_lorsa(hf, adapter, LAYER)
    save(ours, tmp_path / "l", format="llamascopium")
    ids = random_ids(2, 7, seed=2)
    outs = []
    for lorsas in (LorsaSet(model, {LAYER: ours}), LorsaSet.from_pretrained(model, tmp_path / "l")):
        with torch.no_grad(), model.trace(ids):
            lorsas.replace(layer=LAYER)
            outs.append(unembed(model).output.save())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(("family", "hooks", "error", "match"), [
    ("gemma2", {}, UnsupportedArchitectureError, "hook_attn_out on gemma2 is the post-attention norm's output"),
    ("olmo2", {}, UnsupportedArchitectureError, "hook_attn_out on olmo2 is the post-attention norm's output"),
    ("llama", {"hook_in": "hook_resid_pre"}, UnsupportedArchitectureError, "is not the attention's normalised input"),
    ("llama", {"hook_out": "hook_resid_post"}, UnsupportedArchitectureError, "is not the attention's output"),
    ("llama", {"in_layer": 2}, ConfigMismatchError, r"hook_point_out 'blocks.1.hook_attn_out' is layer 1, not layer 2"),
])
def test_a_llamascopium_lorsa_whose_hooks_the_attention_site_does_not_give_is_refused(family, hooks, error, match,
                                                                                     tmp_path):
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    save(_their_lorsa(hf, adapter, **hooks), tmp_path / "theirs", format="llamascopium")
    with pytest.raises(error, match=match):
        LorsaSet.from_pretrained(model, tmp_path / "theirs")


def test_an_unfolded_llamascopium_lorsa_given_to_a_set_is_refused_where_the_norm_has_a_gain(tmp_path):
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    save(_their_lorsa(hf, adapter), tmp_path / "theirs", format="llamascopium")
    norm = hf.get_submodule(adapter.attention_norm_path(LAYER))
    with torch.no_grad():
        norm.weight.fill_(1.0)  # gain 1: ln1.hook_normalized is the attention's input itself
    LorsaSet(model, {LAYER: load(tmp_path / "theirs")})
    _norm_with_gain(hf, adapter)
    with pytest.raises(ConfigMismatchError, match=r"load it with LorsaSet.from_pretrained\(model, directory\)"):
        LorsaSet(model, {LAYER: load(tmp_path / "theirs")})
    with torch.no_grad():
        norm.weight[3] = 0.0
    with pytest.raises(ConfigMismatchError, match="1 zero gains"):
        LorsaSet.from_pretrained(model, tmp_path / "theirs")


def test_an_authors_lorsa_on_a_meta_model_is_refused_with_the_recipe_and_the_folded_folder_loads(tmp_path):
    """On a model whose weights are on ``meta`` (an NDIF client's) the gain cannot be folded: a named error saying
    how to fold it once where the weights are; the folder saved from a loaded model then loads on the meta one."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    _norm_with_gain(hf, adapter)
    save(_their_lorsa(hf, adapter), tmp_path / "theirs", format="llamascopium")
    meta, _ = tiny_nnsight("llama", device="meta")
    with pytest.raises(ConfigMismatchError, match=r"not loaded \(meta\).*LorsaSet.from_pretrained\(loaded, directory\)"
                                                  r"\.save\(folder\)"):
        LorsaSet.from_pretrained(meta, tmp_path / "theirs")
    LorsaSet.from_pretrained(model, tmp_path / "theirs").save(tmp_path / "folded")
    folded = LorsaSet.from_pretrained(meta, tmp_path / "folded")
    assert folded[LAYER].cfg.extra["llamascopium"]["site"] == "attention"


@pytest.mark.parametrize("family", ["llama", "gpt2", "neox"])
def test_a_lorsa_of_ours_saved_with_its_model_is_a_llamascopium_lorsa_of_ln1_hook_normalized(family, tmp_path):
    """``save(lorsa, dir, format="llamascopium", model=model)`` folds the layer's norm gain and bias out: the file's
    Lorsa, fed TransformerLens's ``x̂`` as their library feeds it, computes what ours computes on the attention's
    input (without ``model=`` the file is right for their library only where the gain is 1); a set folds it back."""
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    norm = _norm_with_gain(hf, adapter)
    ours = make_lorsa(hf, adapter, LAYER)
    with torch.no_grad():
        ours.b_Q.normal_(0, 0.1)
        ours.b_V.normal_(0, 0.1)
    save(ours, tmp_path / "l", format="llamascopium", model=model)
    theirs = load(tmp_path / "l")
    assert "site" not in theirs.cfg.extra["llamascopium"]  # no mark: the TransformerLens form
    ids = random_ids(2, 8, seed=6)
    want = _reference_logits(hf, adapter, theirs, norm, ids)
    outs = []
    for lorsas in (LorsaSet(model, {LAYER: ours}), LorsaSet.from_pretrained(model, tmp_path / "l")):
        with torch.no_grad(), model.trace(ids):
            lorsas.replace(layer=LAYER)
            outs.append(unembed(model).output.save())
    scale = float(want.abs().max())
    assert float((outs[0] - want).abs().max()) <= 2e-5 * scale
    assert float((outs[1] - outs[0]).abs().max()) <= 2e-5 * scale


def test_save_with_the_model_refuses_what_has_no_transformerlens_form(tmp_path):
    from nnsight_lorsa.errors import ArgumentError

    model, hf = tiny_nnsight("gemma2")
    with pytest.raises(UnsupportedArchitectureError, match="hook_attn_out is"):
        save(make_lorsa(hf, get_adapter(model), LAYER), tmp_path / "g", format="llamascopium", model=model)
    model, hf = tiny_nnsight("llama")
    with pytest.raises(ArgumentError, match="reads ln1.hook_normalized already"):
        save(_their_lorsa(hf, get_adapter(model)), tmp_path / "t", format="llamascopium", model=model)
