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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


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


def test_a_batchtopk_k_of_zero_is_refused(tmp_path: Path) -> None:
    # module docstring: k must be a whole number (positive: BatchTopK of 0 keeps nothing)
    d = _copy(SAELENS / "train_batchtopk", tmp_path / "b", k=0)
    with pytest.raises(UnsupportedArchitectureError, match="positive whole number"):
        load(d)


def test_a_transcoder_config_without_architecture_is_refused_not_read_as_an_sae(tmp_path: Path) -> None:
    # module docstring / _infer_architecture: a d_out (or W_skip) means a transcoder, and transcoders always name
    # their architecture; the evidence then determines none
    from nnsight_lorsa.errors import CheckpointError

    d = _copy(SAELENS / "transcoder", tmp_path / "t", architecture=None)
    with pytest.raises(CheckpointError, match="do not determine one"):
        load(d)


def test_a_saved_head_index_survives_a_saelens_round_trip(tmp_path: Path) -> None:
    # save_saelens keeps a loaded hook_z SAE's hook_head_index (SAELens reads one head's slice there)
    from nnsight_lorsa.formats.saelens import save_saelens

    src = _copy(SAELENS / "standard", tmp_path / "src")
    cfg = json.loads((src / "cfg.json").read_text())
    cfg["metadata"] = {**cfg.get("metadata", {}), "hook_name": "blocks.1.attn.hook_q", "hook_head_index": 2}
    (src / "cfg.json").write_text(json.dumps(cfg))
    module = load(src)
    assert module.cfg.extra["saelens"]["hook_head_index"] == 2
    out = save_saelens(module, tmp_path / "out", hook_name="blocks.1.attn.hook_q")
    assert json.loads((out / "cfg.json").read_text())["metadata"]["hook_head_index"] == 2
    assert load(out).cfg.extra["saelens"]["hook_head_index"] == 2


# --------------------------------------------------------------------------- circuit-tracer
CIRCUIT_TRACER = PEER_FIXTURES / "circuit_tracer"


def _set_copy(dst: Path, config: dict[str, object], names: dict[str, str] | None = None) -> Path:
    """circuit-tracer's transcoders_relu set with its files renamed (``names``) and this ``config.yaml``."""
    import yaml

    dst.mkdir()
    for name in ("layer_0.safetensors", "layer_1.safetensors"):
        shutil.copy(CIRCUIT_TRACER / "transcoders_relu" / name, dst / (names or {}).get(name, name))
    (dst / "config.yaml").write_text(yaml.safe_dump(config))
    return dst


def test_a_listed_set_without_model_kind_is_a_transcoder_set(tmp_path: Path) -> None:
    # choose_reader: no model_kind -> a CLT only when W_enc_0.safetensors exists; files listed under other names
    from nnsight_lorsa.formats.circuit_tracer import CircuitTracerTranscoders

    d = _set_copy(tmp_path / "s", {"transcoders": ["first.safetensors", "second.safetensors"]},
                  {"layer_0.safetensors": "first.safetensors", "layer_1.safetensors": "second.safetensors"})
    ts = load(d, format="circuit_tracer")
    assert isinstance(ts, CircuitTracerTranscoders) and sorted(ts.transcoders) == [0, 1]
    ref = load_file(str(CIRCUIT_TRACER / "transcoders_relu" / "reference.safetensors"))
    with torch.no_grad():
        for i in range(2):
            assert _rel(ts[i](ref["x"]), ref[f"forward_{i}"]) <= 1e-5


def test_a_listed_file_named_for_another_layer_is_refused(tmp_path: Path) -> None:
    # circuit-tracer's resolve_transcoder_paths loads entry i as layer i: layer_1.safetensors as entry 0 is refused
    from nnsight_lorsa.errors import CheckpointError

    d = _set_copy(tmp_path / "s", {"model_kind": "transcoder_set", "transcoders": ["layer_1.safetensors"]})
    with pytest.raises(CheckpointError, match="named for layer 1"):
        load(d)


def test_config_activation_jump_relu_is_circuit_tracers_jumprelu(tmp_path: Path) -> None:
    # module docstring: config.yaml's optional activation; circuit-tracer spells JumpReLU 'jump_relu'
    import yaml

    d = tmp_path / "j"
    shutil.copytree(CIRCUIT_TRACER / "transcoders_jumprelu", d)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    (d / "config.yaml").write_text(yaml.safe_dump({**cfg, "activation": "jump_relu"}))
    ts = load(d)
    ref = load_file(str(d / "reference.safetensors"))
    with torch.no_grad():
        for i in range(2):
            assert ts[i].cfg.activation == "jumprelu"
            assert _rel(ts[i](ref["x"]), ref[f"forward_{i}"]) <= 1e-5


def test_a_transcoder_set_with_another_output_width_is_refused_for_circuit_tracer(tmp_path: Path) -> None:
    # d_out != d_in: circuit-tracer sizes W_enc and W_skip from b_dec (load_relu_transcoder) and refuses the file
    # (a fuzz against it, 2026-11-29); written until then, read back by our reader only
    from nnsight_lorsa.errors import UnsupportedArchitectureError
    from nnsight_lorsa.formats.circuit_tracer import save_circuit_tracer_transcoders
    from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig

    tcs = {i: Transcoder(TranscoderConfig(d_in=8, d_sae=16, d_out=6, layer=i)) for i in range(2)}
    with pytest.raises(UnsupportedArchitectureError, match="d_out=6 != d_in=8"):
        save_circuit_tracer_transcoders(tcs, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def _random_transcoders(layers: list[int]) -> dict[int, object]:
    from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig

    g = torch.Generator().manual_seed(1)
    out = {}
    for i in layers:  # in the order given
        tc = Transcoder(TranscoderConfig(d_in=8, d_sae=16, layer=i))
        with torch.no_grad():
            for p in tc.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        out[i] = tc
    return out


def test_a_set_given_out_of_layer_order_is_saved_listed_in_layer_order(tmp_path: Path) -> None:
    # circuit-tracer's config.yaml lists one file per layer in order (entry i is layer i)
    from nnsight_lorsa.formats.circuit_tracer import save_circuit_tracer_transcoders

    tcs = _random_transcoders([1, 0])
    back = load(save_circuit_tracer_transcoders(tcs, tmp_path / "s"))  # type: ignore[arg-type]
    x = torch.randn(3, 8)
    with torch.no_grad():
        for i in (0, 1):
            assert _rel(back[i](x), tcs[i](x)) <= 1e-6  # type: ignore[operator]


def test_a_set_with_a_skip_path_on_one_layer_only_is_refused_for_circuit_tracer(tmp_path: Path) -> None:
    # circuit-tracer's TranscoderSet takes layer 0's skip flag for every layer: a later layer's skip path left out of
    # its attribution, or refused (a fuzz against it, 2026-11-29); written until then
    from nnsight_lorsa.errors import UnsupportedArchitectureError
    from nnsight_lorsa.formats.circuit_tracer import save_circuit_tracer_transcoders
    from nnsight_lorsa.modules.transcoder import SkipTranscoder, TranscoderConfig

    tcs = _random_transcoders([0])
    tcs[1] = SkipTranscoder(TranscoderConfig(d_in=8, d_sae=16, layer=1))
    with pytest.raises(UnsupportedArchitectureError, match="differ in width or skip path"):
        save_circuit_tracer_transcoders(tcs, tmp_path / "s")  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("hook", ["mlp.hook_out", "hook_resid_mid"])
def test_an_input_hook_that_is_not_the_mlp_input_is_refused_on_save(hook: str, tmp_path: Path) -> None:
    # _check_written_hooks: feature_input_hook must name the MLP module's input (hook_sites.MLP_INPUT_HOOKS)
    from nnsight_lorsa.formats.circuit_tracer import save_circuit_tracer_transcoders

    with pytest.raises(UnsupportedArchitectureError, match="feature_input_hook"):
        save_circuit_tracer_transcoders(_random_transcoders([0]), tmp_path / "s",  # type: ignore[arg-type]
                                        feature_input_hook=hook)
    assert not (tmp_path / "s").exists()


def test_layer_files_of_two_widths_are_refused(tmp_path: Path) -> None:
    # circuit-tracer's set is one width (peer fixture set_d_model_per_layer: 8 / 6 per layer fails there)
    from nnsight_lorsa.errors import CheckpointError

    with pytest.raises(CheckpointError, match="disagree on"):
        load(PEER_FIXTURES / "probe_circuit_tracer" / "set_d_model_per_layer")


# --------------------------------------------------------------------------- Llamascopium
LLAMASCOPIUM = PEER_FIXTURES / "llamascopium"
#: keys scripts/peer_fixtures/llamascopium.py passes to their LorsaConfig (make(): the rest of each config.json is
#: what their model_dump wrote for their own defaults), and what each case passes besides
PASSED = {"sae_type", "d_model", "expansion_factor", "n_qk_heads", "d_qk_head", "rotary_dim", "n_ctx", "hook_point_in",
          "hook_point_out", "act_fn", "top_k", "norm_activation"}
CASE_PASSED = {"folded_inference": set(), "relu_neox_qknorm": {"rotary_adjacent_pairs", "use_post_qk_ln",
                                                               "normalization_type"},
               "rotary_scale_2": {"rotary_scale"}}


def _lorsa_copy(case: str, dst: Path, keep: set[str] | None = None, **changes: object) -> Path:
    """A copy of a Llamascopium case; ``keep`` given: only those ``config.json`` keys stay; ``changes`` (``None``
    removes a key)."""
    shutil.copytree(LLAMASCOPIUM / case, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if keep is not None:
        cfg = {k: v for k, v in cfg.items() if k in keep}
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


@pytest.mark.parametrize("case", sorted(CASE_PASSED))
def test_a_lorsa_config_without_the_keys_the_peer_left_at_their_defaults_gives_the_peers_outputs(
        case: str, tmp_path: Path) -> None:
    # the keys the fixture script did not pass hold llamascopium's own defaults (rotary_base, rotary_adjacent_pairs,
    # eps, attn_scale = √ of the stored d_qk_head, sparsity_include_decoder_norm, ...): our defaults must be theirs
    d = _lorsa_copy(case, tmp_path / case, keep=PASSED | CASE_PASSED[case])
    dropped = set(json.loads((LLAMASCOPIUM / case / "config.json").read_text())) - PASSED - CASE_PASSED[case]
    assert {"rotary_base", "eps", "attn_scale", "sparsity_include_decoder_norm"} <= dropped
    ref = load_file(str(d / "reference.safetensors"))
    module = load(d)
    written = json.loads((LLAMASCOPIUM / case / "config.json").read_text())
    assert module.cfg.qk_norm_eps == written["eps"]  # 1e-6; barely changes these outputs, so checked as a value
    assert module.cfg.attn_scale == pytest.approx(written["attn_scale"], rel=1e-12)
    with torch.no_grad():
        out, cache = module(ref["x"], return_cache=True)
    assert _rel(out, ref["out"]) <= 1e-5
    assert _rel(cache.z, ref["head_act"]) <= 1e-5
    assert torch.equal(cache.z != 0, ref["active"])


def test_ntk_by_parts_without_old_context_len_takes_the_peers_default(tmp_path: Path) -> None:
    # llamascopium wrote old_context_len=2048 where the fixture script passed none (folded_inference)
    default = json.loads((LLAMASCOPIUM / "folded_inference" / "config.json").read_text())["old_context_len"]
    d = _lorsa_copy("ntk_by_parts", tmp_path / "n", old_context_len=None)
    state = load_file(str(d / "sae_weights.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("rotary_")}, str(d / "sae_weights.safetensors"))
    rotary = load(d).cfg.rotary
    assert rotary is not None and rotary.rope_type == "llama3"
    assert rotary.scaling["original_max_position_embeddings"] == default


def test_only_a_step_folder_under_checkpoints_is_read_as_a_trainer_checkpoint(tmp_path: Path) -> None:
    # rule 2 of the module docstring: Trainer.save_checkpoint writes checkpoints/step_<N>/; a "dataset-wise" folder
    # merely named step_<N> elsewhere is rule 3 (ambiguous: reading folded weights as unfolded applies the norm twice)
    from nnsight_lorsa.errors import CheckpointError

    elsewhere = _lorsa_copy("save_pretrained_dataset_wise", tmp_path / "runs" / "step_3")
    with pytest.raises(CheckpointError, match="does not say whether the weights"):
        load(elsewhere)
    trainer = _lorsa_copy("save_pretrained_dataset_wise", tmp_path / "checkpoints" / "step_3")
    ref = load_file(str(trainer / "reference.safetensors"))  # unfolded weights: the loader folds the norms
    with torch.no_grad():
        assert _rel(load(trainer)(ref["x"]), ref["out"]) <= 1e-5


def test_the_layer_is_read_from_a_two_digit_hook_point(tmp_path: Path) -> None:
    d = _lorsa_copy("folded_inference", tmp_path / "l", hook_point_in="blocks.12.ln1.hook_normalized",
                    hook_point_out="blocks.12.hook_attn_out")
    assert load(d).cfg.layer == 12


def test_a_saved_lorsa_without_hook_points_names_its_layers_attention_hooks(tmp_path: Path) -> None:
    # save_llamascopium_lorsa's documented default: TransformerLens names of cfg.layer
    from nnsight_lorsa.formats.llamascopium import save_llamascopium_lorsa
    from nnsight_lorsa.modules.lorsa import Lorsa
    from nnsight_lorsa.modules.lorsa_config import LorsaConfig

    lorsa = Lorsa(LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=4, n_ov_heads=8, top_k=2, layer=3))
    cfg = json.loads((save_llamascopium_lorsa(lorsa, tmp_path / "s") / "config.json").read_text())
    assert (cfg["hook_point_in"], cfg["hook_point_out"]) == ("blocks.3.ln1.hook_normalized", "blocks.3.hook_attn_out")


@pytest.mark.parametrize("interleaved", [True, False])
def test_a_saved_lorsa_with_uneven_decoder_norms_and_rope_reloads_with_the_same_heads_and_outputs(
        interleaved: bool, tmp_path: Path) -> None:
    # save_llamascopium_lorsa writes sparsity_include_decoder_norm: false (our top-k ranks z itself) and the pair
    # layout of our RoPE; a reload that rescaled by ‖W_O‖ or rotated other pairs would pick other heads
    from nnsight_lorsa.formats.llamascopium import save_llamascopium_lorsa
    from nnsight_lorsa.modules.lorsa import Lorsa
    from nnsight_lorsa.modules.lorsa_config import LorsaConfig
    from nnsight_lorsa.modules.rotary import RotaryConfig

    cfg = LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=8, n_ov_heads=12, top_k=3, layer=1,
                      rotary=RotaryConfig(8, 8, 10000.0, interleaved))
    lorsa = Lorsa(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lorsa.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        lorsa.W_O.mul_(torch.linspace(0.2, 3.0, 12)[:, None])  # decoder norms far from 1 and from each other
    back = load(save_llamascopium_lorsa(lorsa, tmp_path / "s"))
    x = torch.randn(2, 10, 16, generator=g)
    with torch.no_grad():
        out, cache = lorsa(x, return_cache=True)
        out2, cache2 = back(x, return_cache=True)
    assert torch.equal(cache.z != 0, cache2.z != 0)
    assert _rel(out2, out) <= 1e-5 and _rel(cache2.z, cache.z) <= 1e-5
