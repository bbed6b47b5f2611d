"""GemmaScope-2 transcoder sets and CLTs (lower-case ``w_enc`` / ``w_dec`` / ``threshold`` /
``affine_skip_connection`` files) load with our ``load`` and reproduce circuit-tracer 0.5.0's own
``load_gemma_scope_2_transcoder`` / ``load_gemma_scope_2_clt`` outputs (``tests/fixtures/peers/circuit_tracer/
gemma_scope_2/``, written by ``scripts/peer_fixtures/gemma_scope_2.py`` in circuit-tracer's venv); placed by their
hooks on a tiny Gemma-3 their attribution graphs are exact; malformed or mixed files are refused by name. No
circuit-tracer here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import random_ids, tiny_nnsight
from peer_reference import PEER_FIXTURES, rel_error
from safetensors.torch import load_file, save_file

from nnsight_lorsa import CLTSet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import CheckpointError, ConfigMismatchError
from nnsight_lorsa.formats import load
from nnsight_lorsa.formats.circuit_tracer import CircuitTracerTranscoders
from nnsight_lorsa.modules.clt import CrossLayerTranscoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder

FIX = PEER_FIXTURES / "circuit_tracer" / "gemma_scope_2"
REL = 1e-6  # fp32, the same arithmetic up to summation order
N_LAYERS = 3


@pytest.mark.parametrize("case", ["transcoders", "transcoders_skip"])
def test_transcoder_set_matches_circuit_tracer(case: str) -> None:
    ref = load_file(str(FIX / case / "reference.safetensors"))
    ts = load(FIX / case)  # format detected; the layout by its tensor names
    assert isinstance(ts, CircuitTracerTranscoders) and len(ts) == N_LAYERS
    assert (ts.feature_input_hook, ts.feature_output_hook) == ("hook_resid_mid", "hook_mlp_out")
    x = ref["x"]
    for i in range(N_LAYERS):
        tc = ts[i]
        assert tc.cfg.activation == "jumprelu" and tc.cfg.layer == i
        assert isinstance(tc, SkipTranscoder) == (case == "transcoders_skip")
        with torch.no_grad():
            acts = tc.encode(x)
            assert rel_error(acts, ref[f"encode_{i}"]) <= REL
            assert torch.equal(acts != 0, ref[f"encode_{i}"] != 0)
            assert rel_error(tc(x), ref[f"forward_{i}"]) <= REL
            pre = x @ tc.W_enc + tc.b_enc  # the thresholds cut: a ReLU reading would differ
            assert bool(((pre > 0) & (acts == 0)).any())


@pytest.mark.parametrize("case", ["clt", "clt_skip"])
def test_clt_matches_circuit_tracer_on_every_layer(case: str) -> None:
    """Every listed layer is read. circuit-tracer 0.5.0's ``load_gemma_scope_2_clt`` stacks
    ``range(max(paths.keys()))`` layers (n − 1 of the n listed) and then refuses its own W_dec shapes
    (``limits.json``, recorded with its code); its references were computed by the same function given one more
    (never opened) key, so that it reads all n."""
    limits = json.loads((FIX / "limits.json").read_text())["load_gemma_scope_2_clt"][case]
    assert limits["as_listed"]["loads"] is False and "size mismatch for W_dec.0" in limits["as_listed"]["error"]
    ref = load_file(str(FIX / case / "reference.safetensors"))
    clt = load(FIX / case)
    assert isinstance(clt, CrossLayerTranscoder) and clt.n_layers == N_LAYERS  # every listed layer
    assert clt.cfg.activation == "jumprelu" and clt.cfg.skip == (case == "clt_skip")
    x = ref["x"]
    with torch.no_grad():
        acts = clt.encode(x)
        assert rel_error(acts, ref["encode"]) <= REL
        assert torch.equal(acts != 0, ref["encode"] != 0)
        assert rel_error(clt(x), ref["forward"]) <= REL
        per_layer = list(acts.unbind(0))
        for layer in range(N_LAYERS):  # each MLP output on its own, the last layer included
            assert rel_error(clt.reconstruct_layer(per_layer, layer, x[layer]), ref["forward"][layer]) <= REL
            assert rel_error(clt.encode_layer(x[layer], layer), ref["encode"][layer]) <= REL


# --------------------------------------------------------------------------- placement and attribution
def _gs2_layer(g: torch.Generator, d: int, d_sae: int, *, skip: bool,
               n_layers: int | None = None) -> dict[str, torch.Tensor]:
    """One GemmaScope-2 file's tensors (``load_gemma_scope_2_transcoder`` / ``_clt``'s keys)."""
    w_dec_shape = (d_sae, d) if n_layers is None else (d_sae, n_layers, d)
    t = {"w_enc": torch.randn(d, d_sae, generator=g) * 0.3, "w_dec": torch.randn(*w_dec_shape, generator=g) * 0.1,
         "b_enc": torch.randn(d_sae, generator=g) * 0.1, "b_dec": torch.randn(d, generator=g) * 0.05,
         "threshold": torch.rand(d_sae, generator=g) * 0.3}
    if skip:
        t["affine_skip_connection"] = torch.randn(d, d, generator=g) * 0.02
    return t


def _write(directory: Path, kind: str, layers: list[dict[str, torch.Tensor]], names: list[str] | None = None,
           **cfg: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = names or [f"layer_{i}.safetensors" for i in range(len(layers))]
    for name, tensors in zip(names, layers, strict=True):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / name))
    config = {"model_kind": kind, "repo_id": "someone/renamed-dictionaries",  # detected by tensor names, not repo
              "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out", "transcoders": names,
              **cfg}
    (directory / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return directory


def test_placed_by_hooks_on_gemma3_and_attribution_is_exact(tmp_path: Path) -> None:
    """``hook_resid_mid`` → ``hook_mlp_out`` files on a tiny Gemma-3: the sets read the pre-MLP norm's input and
    replace ``post_feedforward_layernorm``'s output; the attribution graphs' edges sum to the node values."""
    from nnsight_lorsa.attribution import attribute
    from nnsight_lorsa.envoy.replacement_model import ReplacementModel

    model, _ = tiny_nnsight("gemma3")
    adapter = get_adapter(model)
    d, n = adapter.d_model, adapter.n_layers
    g = torch.Generator().manual_seed(0)
    tc_dir = _write(tmp_path / "set", "transcoder_set", [_gs2_layer(g, d, 32, skip=True) for _ in range(n)],
                    [f"transcoder/layer_{i}_width_32/params.safetensors" for i in range(n)])
    clt_dir = _write(tmp_path / "clt", "cross_layer_transcoder",
                     [_gs2_layer(g, d, 16, skip=False, n_layers=n) for _ in range(n)])
    tcs = TranscoderSet.from_pretrained(model, tc_dir)
    clts = CLTSet.from_pretrained(model, clt_dir)
    assert sorted(tcs) == list(range(n))
    for layer in range(n):
        assert tcs.site(layer).site_paths == (adapter.mlp_post_norm_path(layer),)
        assert clts.site().site_paths[layer] == adapter.mlp_post_norm_path(layer)
    ids = random_ids()
    for transcoders in (tcs, clts):
        graph = attribute(ReplacementModel(model, transcoders=transcoders), ids[0], max_feature_nodes=8)
        assert graph.edge_sum_error("mass").max() < 1e-5


# --------------------------------------------------------------------------- refusals
def _set(tmp_path: Path, **edit: object) -> Path:
    """A 2-layer GemmaScope-2 set (d_model 8) with ``edit`` applied to layer 1's tensors (None removes a key)."""
    g = torch.Generator().manual_seed(1)
    layers = [_gs2_layer(g, 8, 16, skip=False) for _ in range(2)]
    for k, v in edit.items():
        if v is None:
            layers[1].pop(k)
        else:
            layers[1][k] = v  # type: ignore[assignment]
    return _write(tmp_path / "set", "transcoder_set", layers)


@pytest.mark.parametrize(("edit", "match"), [
    ({"W_enc": torch.zeros(16, 8)}, "mixes circuit-tracer's keys"),
    ({"threshold": None}, r"layer_1\.safetensors: missing tensors \['threshold'\]"),
    ({"w_dec": torch.zeros(16, 2, 8)}, "model_kind: cross_layer_transcoder"),
    ({"w_dec": torch.zeros(16, 7)}, r"'w_dec' has shape \(16, 7\)"),
    ({"affine_skip_connection": torch.zeros(8, 9)}, r"'affine_skip_connection' has shape \(8, 9\)"),
    ({"b_enc": torch.full((16,), float("nan"))}, r"layer_1\.safetensors: tensors \['b_enc'\] have non-finite"),
    ({"w_enc": torch.zeros(8, 16, dtype=torch.int32)}, r"layer_1\.safetensors: tensor 'w_enc' has non-floating"),
])
def test_malformed_transcoder_files_are_refused(tmp_path: Path, edit: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        load(_set(tmp_path, **edit))


def test_mixed_layouts_are_refused(tmp_path: Path) -> None:
    """One loader per set in circuit-tracer: a GemmaScope-2 layer beside a circuit-tracer one is refused."""
    directory = _set(tmp_path)
    state = load_file(str(directory / "layer_1.safetensors"))
    save_file({"W_enc": state["w_enc"].T.contiguous(), "W_dec": state["w_dec"], "b_enc": state["b_enc"],
               "b_dec": state["b_dec"]}, str(directory / "layer_1.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers \[0\] are GemmaScope-2 files"):
        load(directory)


def test_width_mismatch_is_a_config_mismatch(tmp_path: Path) -> None:
    with pytest.raises(ConfigMismatchError, match="w_enc.shape"):
        load(_set(tmp_path), d_model=12)


def _clt(tmp_path: Path, layers: list[dict[str, torch.Tensor]] | None = None) -> Path:
    g = torch.Generator().manual_seed(2)
    layers = layers or [_gs2_layer(g, 8, 16, skip=False, n_layers=3) for _ in range(3)]
    return _write(tmp_path / "clt", "cross_layer_transcoder", layers)


def test_malformed_clt_files_are_refused(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    # w_dec spanning n - 1 layers (what circuit-tracer's range(max(keys)) would accept, dropping the last file)
    short = [_gs2_layer(g, 8, 16, skip=False, n_layers=2) for _ in range(3)]
    with pytest.raises(CheckpointError, match=r"'w_dec' has shape \(16, 2, 8\)"):
        load(_clt(tmp_path / "a", short))
    # a skip path in layer 0 only
    layers = [_gs2_layer(g, 8, 16, skip=i == 0, n_layers=3) for i in range(3)]
    with pytest.raises(CheckpointError, match=r"layer_1\.safetensors: missing tensors \['affine_skip_connection'\]"):
        load(_clt(tmp_path / "b", layers))
    # no threshold
    layers = [_gs2_layer(g, 8, 16, skip=False, n_layers=3) for _ in range(3)]
    layers[2].pop("threshold")
    with pytest.raises(CheckpointError, match=r"layer_2\.safetensors: missing tensors \['threshold'\]"):
        load(_clt(tmp_path / "c", layers))
    # circuit-tracer's own CLT files listed as layer files
    ct = _clt(tmp_path / "d")
    save_file({"W_enc_0": torch.zeros(16, 8), "b_enc_0": torch.zeros(16), "b_dec_0": torch.zeros(8)},
              str(ct / "layer_0.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'w_enc'.*GemmaScope-2 CLT"):
        load(ct)
    # both CLT layouts in one folder
    both = _clt(tmp_path / "e")
    shutil.copy(FIX.parent / "clt_jumprelu" / "W_enc_0.safetensors", both / "W_enc_0.safetensors")
    with pytest.raises(CheckpointError, match="one CLT layout per folder"):
        load(both)
    # a layer numbered out of order
    gap = _clt(tmp_path / "f")
    cfg = yaml.safe_load((gap / "config.yaml").read_text())
    cfg["transcoders"] = [{"layer": i, "filepath": f"layer_{i}.safetensors"} for i in (0, 2)]
    (gap / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CheckpointError, match="GemmaScope-2 CLT's layer files must cover"):
        load(gap)
