"""Round 10 mutation probe of the peers' formats (``formats/saelens.py``, ``formats/circuit_tracer.py``,
``formats/llamascopium.py``): each test here was seen failing with one hand-made mutant of those files
(docs/reliability.md, "Mutation probe, round 10: SAELens, circuit-tracer and Llamascopium files") and
passes without it. References: the peers' own files and outputs (``tests/fixtures/peers/``), their
documented defaults and rules, plain torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peer_reference import PEER_FIXTURES, check_coder
from safetensors.torch import load_file, save_file

from nnsight_lorsa.errors import UnsupportedArchitectureError
from nnsight_lorsa.formats import load

SAELENS = PEER_FIXTURES / "saelens"


def _copy(case: Path, dst: Path, **changes: object) -> Path:
    """A copy of a peer case with ``cfg.json`` keys changed (``None`` removes the key)."""
    shutil.copytree(case, dst)
    cfg = json.loads((dst / "cfg.json").read_text())
    cfg.update(changes)
    (dst / "cfg.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


# --------------------------------------------------------------------------- SAELens
@pytest.mark.parametrize("case", ["transcoder", "skip_transcoder"])
@pytest.mark.parametrize("norm", ["layer_norm", "constant_norm_rescale"])
def test_a_run_time_normalisation_on_any_transcoder_is_refused(case: str, norm: str, tmp_path: Path) -> None:
    # module docstring: constant_norm_rescale / layer_norm on a transcoder -> UnsupportedArchitectureError
    # (our transcoders and skip transcoders do not normalise their input); loading would silently drop it
    d = _copy(SAELENS / case, tmp_path / case, normalize_activations=norm)
    with pytest.raises(UnsupportedArchitectureError, match="normalize_activations"):
        load(d)


@pytest.mark.parametrize("case", ["standard", "topk", "jumprelu"])
def test_an_sae_config_without_apply_b_dec_to_input_takes_saelens_default_true(case: str, tmp_path: Path) -> None:
    # SAELens SAEConfig.apply_b_dec_to_input defaults to True; these cases were written with it True,
    # so the key's absence must give the peer's own outputs
    assert json.loads((SAELENS / case / "cfg.json").read_text())["apply_b_dec_to_input"] is True
    d = _copy(SAELENS / case, tmp_path / case, apply_b_dec_to_input=None)
    module = load(d)
    check_coder(module, load_file(str(d / "reference.safetensors")))


def test_a_log_threshold_is_the_log_of_the_jumprelu_threshold(tmp_path: Path) -> None:
    # SAELens JumpReLUTrainingSAE: threshold = exp(log_threshold); the same SAE stored either way
    d = _copy(SAELENS / "jumprelu", tmp_path / "j")
    state = load_file(str(d / "sae_weights.safetensors"))
    theta = state.pop("threshold")
    assert bool((theta > 0).all())
    state["log_threshold"] = theta.log()
    save_file(state, str(d / "sae_weights.safetensors"))
    module = load(d)
    torch.testing.assert_close(module.activation.threshold, theta, rtol=1e-6, atol=0)
    check_coder(module, load_file(str(d / "reference.safetensors")))


@pytest.mark.parametrize("rescale", [False, True])
def test_a_folded_activation_scale_maps_raw_inputs_to_raw_outputs_for_batchtopk(rescale: bool, tmp_path: Path) -> None:
    # module docstring / SAELens fold_activation_norm_scaling_factor: with s folded, ours(x_raw) is the
    # unfolded SAE on x_raw·s, divided by s; its features are the unfolded SAE's on x_raw·s (same pre-activations;
    # with rescale_acts_by_decoder_norm they are in units of ‖W_dec‖, which the fold divides by s)
    s = 4.0
    plain = load(_copy(SAELENS / "train_batchtopk", tmp_path / "a", rescale_acts_by_decoder_norm=rescale))
    folded = load(_copy(SAELENS / "train_batchtopk", tmp_path / "b", rescale_acts_by_decoder_norm=rescale,
                        normalize_activations="expected_average_only_in"), norm_scaling_factor=s)
    assert folded.cfg.extra["saelens"]["norm_folded"] is True
    x = load_file(str(SAELENS / "train_batchtopk" / "reference.safetensors"))["x"]
    with torch.no_grad():
        acts, ref_acts = folded.encode(x / s), plain.encode(x)
        out, ref_out = folded(x / s), plain(x) / s
    assert int((ref_acts != 0).sum()) > 0
    assert torch.equal((acts != 0), (ref_acts != 0))
    torch.testing.assert_close(acts * (s if rescale else 1.0), ref_acts, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
