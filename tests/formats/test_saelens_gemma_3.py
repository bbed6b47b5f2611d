"""GemmaScope-2 (SAELens ``conversion_func: gemma_3``): ``load(release, sae_id)`` and ``load(folder)`` of
``params.safetensors`` (+ optional ``config.json``) folders reproduce SAELens 6.54.12's own
``gemma_3_sae_huggingface_loader`` + ``SAE`` (``tests/fixtures/peers/saelens/gemma_3/``, folders written by hand and
read by SAELens's code in ``make.py``): encode / decode / forward within 1e-6 relative (fp32), its config dict's
hook names, sizes and model name; the resid_post SAE placed on a tiny Gemma-3, the attn_out (``attn.hook_z``) SAE
refused by an SAESet; malformed folders refused by name. No network, no sae-lens here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_nnsight
from peer_reference import PEER_FIXTURES, rel_error
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_probe_hub_fetch import Remote

from nnsight_lorsa import SAESet
from nnsight_lorsa.errors import (
    ArgumentError,
    CheckpointError,
    ConfigMismatchError,
    FormatDetectionError,
    UnsupportedArchitectureError,
)
from nnsight_lorsa.formats import detect_format, load, resolve_release
from nnsight_lorsa.modules.sae import SparseAutoencoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder

FIX = PEER_FIXTURES / "saelens" / "gemma_3"
REPO = FIX / "gemma-scope-2-tiny-pt"
REL = 1e-6  # fp32, SAELens's arithmetic up to summation order
#: case -> (release, sae_id, our class, SAELens's class)
CASES = {
    "resid_post": ("gemma-scope-2-tiny-pt-res", "layer_1_width_16k_l0_small", SparseAutoencoder, "JumpReLUSAE"),
    "mlp_out": ("gemma-scope-2-tiny-pt-mlp", "layer_2_width_16k_l0_small", SparseAutoencoder, "JumpReLUSAE"),
    "attn_out": ("gemma-scope-2-tiny-pt-att", "layer_1_width_16k_l0_small", SparseAutoencoder, "JumpReLUSAE"),
    "transcoder": ("gemma-scope-2-tiny-pt-transcoders", "transcoder/layer_0_width_16k_l0_small", Transcoder,
                   "JumpReLUTranscoder"),
    "skip_transcoder": ("gemma-scope-2-tiny-pt-transcoders", "transcoder/layer_1_width_16k_l0_small_affine",
                        SkipTranscoder, "JumpReLUSkipTranscoder"),
}


def reference(case: str) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Any]]:
    """SAELens's outputs, the file's metadata and SAELens's config dict (``make.py``)."""
    path = FIX / "references" / f"{case}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta, json.loads(meta["cfg"])


def check_outputs(module: Any, case: str) -> None:
    ref, meta, cfg = reference(case)
    assert type(module) is CASES[case][2] and meta["class"] == CASES[case][3]
    assert module.W_enc.dtype == torch.float32  # SAELens casts to its cfg dtype (mlp_out is stored bf16)
    assert module.cfg.activation == "jumprelu"
    sizes = (cfg["d_in"], cfg["d_sae"], cfg.get("d_out", cfg["d_in"]))
    assert (module.cfg.d_in, module.cfg.d_sae, module.d_out) == sizes
    with torch.no_grad():
        acts = module.encode(ref["x"])
        assert rel_error(acts, ref["encode"]) <= REL
        assert torch.equal(acts != 0, ref["encode"] != 0)
        assert rel_error(module.decode(acts), ref["decode"]) <= REL
        assert rel_error(module(ref["x"]), ref["forward"]) <= REL
    extra = module.cfg.extra["saelens"]
    assert extra["architecture"] == cfg["architecture"] and extra["conversion_func"] == "gemma_3"
    assert extra["hook_name"] == cfg["hook_name"] and extra.get("hook_name_out") == cfg.get("hook_name_out")
    assert extra["hf_hook_name"] == cfg["hf_hook_name"] and extra.get("hf_hook_name_out") == cfg.get("hf_hook_name_out")
    assert extra["folder"] == meta["folder"]


@pytest.fixture()
def registry(tmp_path: Path) -> Path:
    """The test registry with its repo a local directory (a copy of the fixture repo)."""
    repo = tmp_path / "gemma-scope-2-tiny-pt"
    shutil.copytree(REPO, repo)
    out = tmp_path / "pretrained_saes.yaml"
    out.write_text((FIX / "pretrained_saes.yaml").read_text().replace("LOCAL/gemma-scope-2-tiny-pt", str(repo)))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_folder_matches_saelens(case: str) -> None:
    _, meta, cfg = reference(case)
    folder = REPO / meta["folder"]
    assert detect_format(folder) == "saelens"  # params.safetensors (+ config.json): the gemma_3 converter's reader
    module = load(folder)  # detected; SAELens's folder_name = the last two parts, its repo = the folder above
    check_outputs(module, case)
    assert module.cfg.extra["saelens"]["model_name"] == cfg["model_name"] == "google/gemma-3-tiny-pt"


@pytest.mark.parametrize("case", list(CASES))
def test_release_matches_saelens(registry: Path, case: str) -> None:
    release, sae_id = CASES[case][:2]
    entry = resolve_release(release, sae_id, registry=registry)
    assert entry.conversion_func == "gemma_3"
    module = load(release, sae_id, release_registry=registry)
    check_outputs(module, case)
    extra = module.cfg.extra["saelens"]
    assert (extra["release"], extra["sae_id"], extra["path"]) == (release, sae_id, entry.path)
    assert load(release, sae_id, release_registry=registry, format="saelens").cfg.d_sae == module.cfg.d_sae
    assert module.cfg.extra["saelens"]["conversion_func"] == "gemma_3"
    with pytest.raises(ArgumentError, match="names its repo folder and format"):
        load(release, sae_id, release_registry=registry, format="sparsify")


def test_sites_as_saelens_names_them() -> None:
    records = {case: load(REPO / reference(case)[1]["folder"]).cfg.extra["saelens"] for case in CASES}
    assert records["resid_post"]["site"] == {"layer": 1, "site": "resid_post", "module_path": None, "io": "output"}
    assert records["mlp_out"]["site"] == {"layer": 2, "site": "mlp_out", "module_path": None, "io": "output"}
    assert records["attn_out"]["hook_name"] == "blocks.1.attn.hook_z" and records["attn_out"]["site"] is None
    for case, layer in (("transcoder", 0), ("skip_transcoder", 1)):
        assert records[case]["hook_name"] == f"blocks.{layer}.hook_mlp_in"  # SAELens's name, kept as it says
        assert records[case]["hook_name_out"] == f"blocks.{layer}.hook_mlp_out"
        assert records[case]["hf_hook_name"] == f"model.layers.{layer}.pre_feedforward_layernorm.output"


def test_resid_post_placed_on_tiny_gemma3() -> None:
    model, _ = tiny_nnsight("gemma3")
    ref = reference("resid_post")[0]
    saes = SAESet.from_pretrained(model, REPO / "resid_post" / "layer_1_width_16k_l0_small")
    assert list(saes) == ["model.layers.1"]  # blocks.1.hook_resid_post = layer 1's output
    with torch.no_grad():
        assert rel_error(saes["model.layers.1"](ref["x"]), ref["forward"]) <= REL


def test_attn_out_refused_by_sae_set() -> None:
    model, _ = tiny_nnsight("gemma3")
    module = load(REPO / "attn_out" / "layer_1_width_16k_l0_small")
    assert module.cfg.d_in == 64  # the model's n_heads * head_dim: loads, and width is not why it is refused
    with pytest.raises(ConfigMismatchError, match="per-head values"):
        SAESet.from_pretrained(model, REPO / "attn_out" / "layer_1_width_16k_l0_small")


def test_clt_and_other_converters_refused(registry: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError, match="cross-layer transcoder"):
        load("gemma-scope-2-tiny-pt-clt", "clt/layer_0", release_registry=registry)
    with pytest.raises(UnsupportedArchitectureError, match="converter 'gemma_2'"):
        load("gemma-scope-tiny-pt-res", "layer_1_width_16k_l0_small", release_registry=registry)


def test_hub_release_fetches_the_folder_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # the repo id is no local path
    remote = Remote(tmp_path, monkeypatch)
    remote.put("google/gemma-scope-2-tiny-pt", REPO)
    registry = tmp_path / "pretrained_saes.yaml"
    registry.write_text((FIX / "pretrained_saes.yaml").read_text().replace("LOCAL/", "google/"))
    for case in ("resid_post", "transcoder"):  # with and without config.json
        remote.fetched.clear()
        module = load(*CASES[case][:2], release_registry=registry)
        check_outputs(module, case)
        folder = reference(case)[1]["folder"]
        assert remote.fetched["google/gemma-scope-2-tiny-pt"] == {
            f"{folder}/{name}" for name in ("params.safetensors", "config.json") if (REPO / folder / name).is_file()}
        # SAELens infers the model name from the repo id (no config.json) or reads it (config.json)
        assert module.cfg.extra["saelens"]["model_name"] == reference(case)[2]["model_name"]


def test_hub_weight_patterns(tmp_path: Path) -> None:
    from nnsight_lorsa.formats.saelens_releases import GEMMA_3_READER

    assert GEMMA_3_READER.weight_files(REPO / "transcoder" / "layer_0_width_16k_l0_small") == ["params.safetensors"]
    assert GEMMA_3_READER.weight_files(REPO / "resid_post" / "layer_1_width_16k_l0_small") == ["params.safetensors"]
    other = tmp_path / "some" / "checkpoint"
    other.mkdir(parents=True)
    assert GEMMA_3_READER.weight_files(other) == []  # another format's folder: nothing of ours fetched
    (other / "config.json").write_text(json.dumps({"format": "nnsight_lorsa.lorsa"}))
    assert GEMMA_3_READER.weight_files(other) == []


def _copy(tmp_path: Path, folder: str) -> Path:
    out = tmp_path / "gemma-scope-2-tiny-pt" / folder
    shutil.copytree(REPO / folder, out)
    return out


def _edit_params(d: Path, edit: Any) -> None:
    state = load_file(str(d / "params.safetensors"))
    edit(state)
    save_file(state, str(d / "params.safetensors"))


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


SKIP = "transcoder/layer_1_width_16k_l0_small_affine"
RES = "resid_post/layer_1_width_16k_l0_small"
TC = "transcoder/layer_0_width_16k_l0_small"


@pytest.mark.parametrize(("folder", "params", "config", "error", "match"), [
    (RES, lambda s: s.pop("threshold"), None, CheckpointError, "missing tensor 'threshold'"),
    (RES, lambda s: s.update(extra=torch.zeros(3)), None, CheckpointError, r"unexpected tensors \['extra'\]"),
    (RES, lambda s: s.update(w_enc=s["w_enc"][None]), None, CheckpointError, "no 2-D tensor 'w_enc'"),
    (RES, lambda s: s.pop("w_enc"), None, CheckpointError, "no 2-D tensor 'w_enc'"),
    (RES, lambda s: s.update(w_dec=s["w_dec"][:, :5].contiguous()), None, CheckpointError, "W_dec"),
    (RES, lambda s: s["b_enc"].__setitem__(0, float("nan")), None, CheckpointError, "non-finite"),
    (RES, lambda s: s.update(affine_skip_connection=torch.zeros(64, 64)), None, CheckpointError, "W_skip"),
    (RES, None, {"architecture": "topk"}, UnsupportedArchitectureError, "'architecture' is 'topk'"),
    (RES, None, {"model_name": None}, CheckpointError, "'model_name' must be a string"),
    (SKIP, lambda s: s.pop("affine_skip_connection"), None, CheckpointError, "W_skip"),
    (SKIP, lambda s: s.update(affine_skip_connection=s["affine_skip_connection"][0]), None, CheckpointError,
     "must be 2-D"),
    (SKIP, None, {"affine_connection": "yes"}, CheckpointError, "'affine_connection' must be true or false"),
    (SKIP, None, {"affine_connection": False}, CheckpointError, "W_skip"),  # a plain transcoder with a skip tensor
    (TC, lambda s: s.update(affine_skip_connection=torch.zeros(16, 12)), None, CheckpointError, "W_skip"),
    (TC, lambda s: s.pop("w_dec"), None, CheckpointError, "no tensor 'w_dec'"),
])
def test_malformed_folders_refused(tmp_path: Path, folder: str, params: Any, config: Any, error: type[Exception],
                                   match: str) -> None:
    d = _copy(tmp_path, folder)
    if params is not None:
        _edit_params(d, params)
    if config is not None:
        _edit_config(d, **config)
    with pytest.raises(error, match=match):
        load(d, format="saelens")


def test_folder_names_that_say_nothing(tmp_path: Path) -> None:
    d = tmp_path / "repo" / "other" / "width_16k"  # no layer, no hook word, no config.json
    shutil.copytree(REPO / TC, d)
    with pytest.raises(FormatDetectionError, match="no known sparse-coder checkpoint files"):
        load(d)
    with pytest.raises(CheckpointError, match="has no 'layer_<L>'"):
        load(d, format="saelens")
    d2 = tmp_path / "repo" / "other" / "layer_3_width_16k"
    shutil.copytree(REPO / TC, d2)
    with pytest.raises(CheckpointError, match="names no hook"):
        load(d2, format="saelens")
    d3 = _copy(tmp_path, RES)
    (d3 / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        load(d3)
    shutil.copy(REPO / RES / "config.json", d3 / "config.json")
    _edit_config(d3, architecture="jumprelu")  # SAELens refuses every architecture but "jump_relu"
    with pytest.raises(FormatDetectionError):
        load(d3)
    with pytest.raises(UnsupportedArchitectureError, match="'jumprelu'"):
        load(d3, format="saelens")


@pytest.mark.parametrize("affine", [False, True])
def test_transcoders_read_the_tensor_their_hf_hook_name_records(tmp_path: Path, affine: bool) -> None:
    """SAELens names a GemmaScope-2 transcoder's input ``hook_mlp_in`` (TransformerLens: the residual before the
    pre-MLP norm) and records ``hf_hook_name: model.layers.L.pre_feedforward_layernorm.output`` — the MLP's input,
    what it was trained on: a ``TranscoderSet`` reads it there (the MLP's own call; until 2026-11-29 the residual
    before the norm), writing ``post_feedforward_layernorm``'s output (``hook_mlp_out`` on Gemma-3); the
    reconstruction is the transcoder of the MLP's input."""
    from safetensors.torch import save_file

    from nnsight_lorsa import TranscoderSet, get_adapter

    model, hf = tiny_nnsight("gemma3")
    adapter = get_adapter(model)
    d, f, layer = adapter.d_model, 24, 1
    g = torch.Generator().manual_seed(5)
    folder = tmp_path / "gemma-scope-2-tiny-pt" / "transcoder" / f"layer_{layer}_width_16k_l0_small"
    folder.mkdir(parents=True)
    params = {"w_enc": torch.randn(d, f, generator=g) * 0.3, "w_dec": torch.randn(f, d, generator=g) * 0.2,
              "b_enc": torch.randn(f, generator=g) * 0.1, "b_dec": torch.randn(d, generator=g) * 0.1,
              "threshold": torch.rand(f, generator=g) * 0.05}
    if affine:
        params["affine_skip_connection"] = torch.randn(d, d, generator=g) * 0.1
    save_file(params, str(folder / "params.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architecture": "jump_relu", "model_name": "gemma-3-tiny-pt", "affine_connection": affine,
        "hf_hook_point_in": f"model.layers.{layer}.pre_feedforward_layernorm.output",
        "hf_hook_point_out": f"model.layers.{layer}.post_feedforward_layernorm.output"}))
    tc = load(folder)
    assert tc.cfg.extra["saelens"]["hook_name"] == f"blocks.{layer}.hook_mlp_in"  # SAELens's name, kept
    tcs = TranscoderSet(model, {layer: tc})
    site = tcs.site(layer)
    assert site.input_paths == (adapter.mlp_path(layer),)
    assert site.site_paths == (adapter.mlp_post_norm_path(layer),)
    seen: list = []
    handle = hf.get_submodule(adapter.mlp_path(layer)).register_forward_pre_hook(
        lambda m, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad(), model.trace(torch.randint(0, 64, (1, 5))):
            recons = tcs.replace(layer).hook_sae_recons.output.save()
    finally:
        handle.remove()
    with torch.no_grad():
        want = tc(seen[0])
    assert float(want.abs().max()) > 0 and rel_error(recons, want) <= REL


@pytest.mark.parametrize("hf_in", [None, "model.layers.1.output", "model.layers.2.pre_feedforward_layernorm.output"])
def test_a_transcoder_whose_config_names_another_input_is_refused(tmp_path: Path, hf_in: Any) -> None:
    """A transcoder folder whose ``config.json`` names no ``hf_hook_point_in``, another tensor or another layer's
    (a helper's fuzz, 2026-11-29: read off the residual before the norm, 0.4–0.64 off in the logits): refused by name
    (the MLP's input of its layer is what a set reads)."""
    from safetensors.torch import save_file

    folder = tmp_path / "gemma-scope-2-tiny-pt" / "transcoder" / "layer_1_width_16k_l0_small"
    folder.mkdir(parents=True)
    save_file({"w_enc": torch.ones(4, 6), "w_dec": torch.ones(6, 4), "b_enc": torch.zeros(6), "b_dec": torch.zeros(4),
               "threshold": torch.zeros(6)}, str(folder / "params.safetensors"))
    cfg = {"architecture": "jump_relu", "model_name": "gemma-3-tiny-pt", "affine_connection": False}
    if hf_in is not None:
        cfg["hf_hook_point_in"] = hf_in
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hf_hook_point_in"):
        load(folder)


def test_a_local_repo_names_the_model_by_its_last_part(tmp_path: Path) -> None:
    """Without ``config.json`` the model name comes from the repo id; a registry whose repo is a local directory
    named it by the whole path (``google//tmp/…``); now by its last part, as SAELens's hub id."""
    from nnsight_lorsa.formats.saelens_releases import gemma_3_cfg_dict

    folder = "mlp_out/layer_2_width_16k_l0_small"
    cfg, _ = gemma_3_cfg_dict(REPO / folder, folder=folder, repo_id=str(tmp_path / "gemma-scope-2-12b-pt"))
    assert cfg["model_name"] == "google/gemma-3-12b-pt"
