"""Files written by circuit-tracer 0.5.0's own code (``tests/fixtures/peers/circuit_tracer/``, from
``scripts/peer_fixtures/circuit_tracer.py``) load with our ``load`` and reproduce circuit-tracer's own
outputs; what its format cannot express is refused by name; our ``save`` in its format loads in
circuit-tracer (``reverse/result.json``, written by circuit-tracer's loaders). No circuit-tracer here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peer_reference import PEER_FIXTURES, rel_error
from safetensors.torch import load_file

from nnsight_lorsa.errors import UnsupportedArchitectureError
from nnsight_lorsa.formats import load, save
from nnsight_lorsa.formats.circuit_tracer import CircuitTracerTranscoders
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig

FIX = PEER_FIXTURES / "circuit_tracer"
SETS = ["transcoders_relu", "transcoders_jumprelu", "transcoders_skip", "transcoders_jumprelu_skip"]
CLTS = ["clt_relu", "clt_jumprelu"]
REL = 1e-5  # fp32, same arithmetic up to summation order


@pytest.mark.parametrize("case", SETS)
def test_transcoder_set_matches_circuit_tracer(case: str) -> None:
    ref = load_file(str(FIX / case / "reference.safetensors"))
    ts = load(FIX / case)  # format detected
    assert isinstance(ts, CircuitTracerTranscoders) and len(ts) == 2
    assert ts.feature_input_hook == "mlp.hook_in" and ts.scan == "tiny-scan"
    x = ref["x"]
    for i in range(2):
        tc = ts[i]
        assert isinstance(tc, SkipTranscoder) == ("skip" in case)
        assert tc.cfg.activation == ("jumprelu" if "jumprelu" in case else "relu")
        with torch.no_grad():
            acts = tc.encode(x)
            assert rel_error(acts, ref[f"encode_{i}"]) <= REL
            assert torch.equal(acts > 0, ref[f"encode_{i}"] > 0)  # same active features
            decoded = tc.decode(acts) + (tc.skip(x) if isinstance(tc, SkipTranscoder) else 0)
            assert rel_error(decoded, ref[f"decode_{i}"]) <= REL  # circuit-tracer's decode adds the skip
            assert rel_error(tc(x), ref[f"forward_{i}"]) <= REL
        if "jumprelu" in case:  # thresholds that actually cut: some pre-activations > 0 are zeroed
            pre = x @ tc.W_enc + tc.b_enc
            assert bool(((pre > 0) & (acts == 0)).any())


@pytest.mark.parametrize("case", CLTS)
def test_clt_matches_circuit_tracer(case: str) -> None:
    ref = load_file(str(FIX / case / "reference.safetensors"))
    clt = load(FIX / case)
    assert isinstance(clt, CrossLayerTranscoder) and clt.n_layers == 3
    assert clt.cfg.activation == ("jumprelu" if "jumprelu" in case else "relu")
    with torch.no_grad():
        assert rel_error(clt.encode(ref["x"]), ref["encode"]) <= REL
        assert rel_error(clt(ref["x"]), ref["forward"]) <= REL


def test_what_circuit_tracer_cannot_express_is_refused(tmp_path: Path) -> None:
    """circuit-tracer's own save + load turn a TopK transcoder into a ReLU one and drop a CLT's skip
    (``limits.json``, measured with its code); our ``save`` refuses both by name instead."""
    limits = json.loads((FIX / "limits.json").read_text())
    assert limits["topk"]["reloaded_activation"] == "relu" and limits["topk"]["max_rel_forward_after_reload"] > 0.01
    assert limits["clt_skip"]["reloaded_has_skip"] is False
    assert limits["clt_skip"]["max_rel_forward_after_reload"] > 0.01
    topk = Transcoder(TranscoderConfig(d_in=8, d_sae=16, activation="topk", activation_params={"k": 4}))
    with pytest.raises(UnsupportedArchitectureError, match="topk"):
        save({0: topk}, tmp_path / "topk", format="circuit_tracer")
    clt = CrossLayerTranscoder(CLTConfig(d_in=8, d_sae=16, n_layers=3, skip=True))
    with pytest.raises(UnsupportedArchitectureError, match="skip"):
        save(clt, tmp_path / "clt", format="circuit_tracer")


def test_our_files_load_in_circuit_tracer() -> None:
    """``reverse/``: what our ``save(format="circuit_tracer")`` wrote, loaded by circuit-tracer's own
    ``load_transcoder_set`` / ``load_clt`` and compared with our outputs there (``result.json``)."""
    result = json.loads((FIX / "reverse" / "result.json").read_text())
    assert set(result["cases"]) == {"transcoders_relu", "transcoders_jumprelu", "transcoders_jumprelu_skip",
                                     *CLTS}
    assert result["pass"] is True
    for name, r in result["cases"].items():
        assert r["pass"] and r["max_rel"] <= REL, name
    # the JumpReLU files carry circuit-tracer's key, and our own reader still reads them
    keys = load_file(str(FIX / "reverse" / "transcoders_jumprelu" / "layer_0.safetensors")).keys()
    assert "activation_function.threshold" in keys and "threshold" not in keys
    ours = load_file(str(FIX / "reverse" / "transcoders_jumprelu" / "ours_outputs.safetensors"))
    with torch.no_grad():
        assert rel_error(load(FIX / "reverse" / "transcoders_jumprelu")[0](ours["x"]), ours["forward_0"]) <= REL


def _listed_set(folder: Path, entries: list[str], decoy: bool = True) -> None:
    """``folder`` with the relu set's files where ``entries`` say (``config.yaml`` listing them), and the jumprelu
    set's files of the same names beside the config as a decoy."""
    import shutil

    import yaml

    src, other = FIX / "transcoders_relu", FIX / "transcoders_jumprelu"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((src / "config.yaml").read_text())
    for i, entry in enumerate(entries):
        inner = entry.split("?")[0].removeprefix("hf://").split("/", 2)[-1] if entry.startswith("hf://") else entry
        (folder / inner).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / f"layer_{i}.safetensors", folder / inner)
        if decoy and (folder / f"layer_{i}.safetensors") != folder / inner:
            shutil.copy(other / f"layer_{i}.safetensors", folder / f"layer_{i}.safetensors")
    cfg["transcoders"] = entries
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))


@pytest.mark.parametrize("entries", [
    ["sub/layer_0.safetensors", "sub/layer_1.safetensors"],
    ["hf://org/repo/width_65k/layer_0.safetensors", "hf://org/repo/width_65k/layer_1.safetensors?revision=main"],
])
def test_listed_files_are_read_where_the_list_says(tmp_path: Path, entries: list[str]) -> None:
    """circuit-tracer (``resolve_transcoder_paths``) opens each listed path, an ``hf://`` URI at its path in the
    repo; only the file's name was kept here, and a ``layer_<i>.safetensors`` beside the config (another set's) was
    read instead without a word (encode up to 3.2 off)."""
    _listed_set(tmp_path / "set", entries)
    ref = load_file(str(FIX / "transcoders_relu" / "reference.safetensors"))
    loaded = load(tmp_path / "set")
    for layer in range(2):
        want = load_file(str(FIX / "transcoders_relu" / f"layer_{layer}.safetensors"))
        assert torch.equal(loaded[layer].W_enc.T, want["W_enc"])
        with torch.no_grad():
            assert rel_error(loaded[layer].encode(ref["x"]), ref[f"encode_{layer}"]) <= REL


def test_an_hf_uri_of_another_repo_is_refused_in_a_snapshot(tmp_path: Path) -> None:
    """In a hub snapshot of ``org/repo`` an entry ``hf://other/repo/...`` is another repo's file (circuit-tracer
    downloads it from there): refused by name; the snapshot's own repo resolves from the snapshot's root."""
    from nnsight_lorsa.errors import CheckpointError

    snapshot = tmp_path / "models--org--repo" / "snapshots" / "abc123"
    _listed_set(snapshot, ["hf://org/repo/w/layer_0.safetensors", "hf://org/repo/w/layer_1.safetensors"])
    assert isinstance(load(snapshot), CircuitTracerTranscoders)
    _listed_set(snapshot, ["hf://other/repo/w/layer_0.safetensors", "hf://other/repo/w/layer_1.safetensors"])
    with pytest.raises(CheckpointError, match=r"'other/repo'.*not of 'org/repo'"):
        load(snapshot)
