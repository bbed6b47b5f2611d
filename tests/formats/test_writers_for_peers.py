"""What our writers hand the peers: a module a peer would compute otherwise is refused by name before anything is
written, and what the peer needs to know is in the file.

Found by a fuzz of our writers against the peers' own loaders (2026-11-29: SAELens 6.54.12, eai-sparsify 1.3.3,
circuit-tracer 0.5.0, llamascopium 2.0.0b34 in their own venvs, docs/reliability.md): sparsify has no input
normalisation (``sparse_coder.py`` ``encode``: ``x − b_dec`` only); circuit-tracer's transcoders read ``x`` itself
(``single_layer_transcoder.py``: ``F.linear(x, W_enc, b_enc)``), size ``W_enc`` / ``W_skip`` from ``b_dec``, assert
one ``d_sae`` per set and take layer 0's skip flag for every layer, and open ``config.yaml``'s listed paths as given
(a bare name against the working directory); SAELens keeps ``expected_average_only_in`` in the file; llamascopium's
``LorsaConfig`` refuses one hook for both ends and reads an integer llama3 context.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import make_lorsa, make_sae, make_transcoder, tiny_nnsight

from nnsight_lorsa import get_adapter, load, save
from nnsight_lorsa.errors import ArgumentError, UnsupportedArchitectureError
from nnsight_lorsa.formats.saelens import save_saelens


@pytest.mark.parametrize("norm", ["layer_norm", "constant_norm_rescale"])
def test_sparsify_refuses_an_sae_that_normalises_its_input(tmp_path, norm):
    sae = make_sae(activation="topk", activation_params={"k": 4}, normalize_activations=norm)
    with pytest.raises(UnsupportedArchitectureError, match=f"normalize_activations={norm!r}.*sparsify"):
        save(sae, tmp_path / "s", format="sparsify")
    assert not (tmp_path / "s").exists()
    save(make_sae(activation="topk", activation_params={"k": 4}), tmp_path / "plain", format="sparsify")


@pytest.mark.parametrize(("case", "match"), [
    ("sae_b_dec_in", "subtracts b_dec"),
    ("sae_normalised", "normalize_activations='layer_norm'"),
    ("d_out", "d_out=48 != d_in=64"),
    ("widths", "differ in width or skip path"),
    ("skip_mixed", "differ in width or skip path"),
])
def test_circuit_tracer_refuses_what_its_transcoders_would_compute_otherwise(tmp_path, case, match):
    relu = {"activation": "relu", "activation_params": {}}
    layers = {0: make_transcoder(skip=False, **relu), 1: make_transcoder(skip=False, seed=1, **relu)}
    if case == "sae_b_dec_in":
        layers[1] = make_sae(apply_b_dec_to_input=True, **relu)
    elif case == "sae_normalised":
        layers[1] = make_sae(apply_b_dec_to_input=False, normalize_activations="layer_norm", **relu)
    elif case == "d_out":
        layers[1] = make_transcoder(skip=False, d_out=48, **relu)
    elif case == "widths":
        layers[1] = make_transcoder(skip=False, d_sae=96, **relu)
    else:
        layers[1] = make_transcoder(skip=True, **relu)
    with pytest.raises(UnsupportedArchitectureError, match=match):
        save(layers, tmp_path / "ct", format="circuit_tracer")
    assert not (tmp_path / "ct").exists()


def test_circuit_tracer_sets_are_written_without_a_list_of_bare_names(tmp_path):
    """circuit-tracer opens each listed path as given: a bare ``layer_0.safetensors`` resolved against the process's
    working directory. Without the list a hub load finds the repo's layer files itself, and so does our reader; an SAE
    that reads ``x`` itself (no ``b_dec`` in, no normalisation) is a transcoder there and is written."""
    relu = {"activation": "relu", "activation_params": {}}
    layers = {0: make_transcoder(skip=False, **relu), 1: make_sae(apply_b_dec_to_input=False, **relu)}
    save(layers, tmp_path / "ct", format="circuit_tracer")
    cfg = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())
    assert "transcoders" not in cfg and cfg["model_kind"] == "transcoder_set"
    back = load(tmp_path / "ct")
    x = torch.randn(5, layers[0].cfg.d_in)
    with torch.no_grad():
        for layer in (0, 1):
            assert torch.equal(back[layer].W_enc, layers[layer].W_enc)
            assert torch.allclose(back[layer](x), layers[layer](x), atol=1e-6)


def test_saelens_keeps_an_unfolded_expected_average_and_the_hook_it_came_with(tmp_path):
    """A SAELens SAE loaded without its ``norm_scaling_factor`` still expects scaled inputs: written back, the file
    says ``expected_average_only_in`` (it said ``none``: SAELens and our reader then fed it raw activations without a
    word); its ``hook_name`` is kept when none is given (it was null)."""
    sae = make_sae(activation="relu", activation_params={})
    save_saelens(sae, tmp_path / "src", hook_name="blocks.1.hook_resid_post")
    cfg_path = tmp_path / "src" / "cfg.json"
    raw = json.loads(cfg_path.read_text())
    raw["normalize_activations"] = "expected_average_only_in"
    cfg_path.write_text(json.dumps(raw))
    (tmp_path / "src" / "checksums.json").unlink(missing_ok=True)
    with pytest.warns(UserWarning, match="norm_scaling_factor"):
        loaded = load(tmp_path / "src")
    save_saelens(loaded, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "cfg.json").read_text())
    assert again["normalize_activations"] == "expected_average_only_in"
    assert again["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    folded = load(tmp_path / "src", norm_scaling_factor=2.0)
    save_saelens(folded, tmp_path / "folded", hook_name="blocks.1.hook_resid_post")
    assert json.loads((tmp_path / "folded" / "cfg.json").read_text())["normalize_activations"] == "none"


def test_llamascopium_refuses_one_hook_for_both_ends_and_a_fractional_llama3_context(tmp_path):
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model), 1)
    with pytest.raises(ArgumentError, match="both 'blocks.1.hook_attn_out'"):
        save(lorsa, tmp_path / "l", format="llamascopium", hook_point_in="blocks.1.hook_attn_out",
             hook_point_out="blocks.1.hook_attn_out")
    rot = lorsa.cfg.rotary
    assert rot is not None
    lorsa.cfg.rotary = type(rot)(head_dim=rot.head_dim, rotary_dim=rot.rotary_dim, base=rot.base,
                                 interleaved=rot.interleaved, rope_type="llama3",
                                 scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 16.5})
    with pytest.raises(UnsupportedArchitectureError, match="original_max_position_embeddings=16.5"):
        save(lorsa, tmp_path / "l", format="llamascopium")
    assert not (tmp_path / "l").exists()
