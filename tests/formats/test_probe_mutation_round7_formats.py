"""Mutation probe, round 7 (docs/reliability.md): the package's own Lorsa and sparse-coder formats, the Lorsa
config's checks and defaults, and Llamascopium SAE loading. Each test was seen failing with one hand-made mutant
of those files and passing on the clean tree; the reference is the files' documented layout or rule (module
docstrings, the peer's config defaults), never the code under test."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import tiny_hf_model
from safetensors.torch import load_file, save_file

from nnsight_lorsa import Lorsa, LorsaConfig, get_adapter
from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.formats import lorsa_format
from nnsight_lorsa.formats.llamascopium_sae import load_llamascopium_sae
from nnsight_lorsa.formats.lorsa_format import load_lorsa, save_lorsa
from nnsight_lorsa.formats.sparse_coder_format import load_sparse_coder, save_sparse_coder
from nnsight_lorsa.modules.rotary import RotaryConfig
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, TranscoderConfig

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers" / "probe_llamascopium"


def _lorsa_dir(tmp_path: Path, **cfg: object) -> Path:
    torch.manual_seed(0)
    config = LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=4, n_ov_heads=4, top_k=2, **cfg)  # type: ignore[arg-type]
    out = save_lorsa(Lorsa(config), tmp_path / "lorsa")
    (out / "checksums.json").unlink()  # hand-edited below: the readers' own checks are what is tested
    return out


def _edit_config(directory: Path, edit: dict[str, object], *, envelope: bool = False) -> None:
    doc = json.loads((directory / "config.json").read_text())
    target = doc if envelope else doc["config"]
    for key, value in edit.items():
        if value is dataclasses.MISSING:
            target.pop(key, None)
        else:
            target[key] = value
    (directory / "config.json").write_text(json.dumps(doc))


# --------------------------------------------------------------------------- lorsa_format
def test_a_lorsa_weights_file_with_another_format_tag_is_refused(tmp_path):
    """The header's ``format`` must be ``nnsight-lorsa`` (module docstring); here the tensors are right and only
    the tag is another format's (mutant: the tag not compared)."""
    directory = _lorsa_dir(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "nnsight-lorsa-sparse-coder",
                                                                   "version": "1"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*header metadata 'format'"):
        load_lorsa(directory)


@pytest.mark.parametrize("change", ["shape", "missing", "unexpected"])
def test_a_lorsa_file_that_disagrees_with_its_config_is_refused_before_its_tensors_are_read(tmp_path, monkeypatch,
                                                                                             change):
    """``load_weights`` checks names and shapes against the config from the header *before loading* (its
    docstring): a wrong file is refused without a tensor read (mutant: the inventory check dropped; the module
    build still refuses it, after reading every tensor)."""
    directory = _lorsa_dir(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    if change == "shape":
        tensors["W_O"] = torch.zeros(5, 8)
    elif change == "missing":
        del tensors["W_O"]
    else:
        tensors["junk"] = torch.zeros(3)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "nnsight-lorsa", "version": "1"})

    def no_read(path: object) -> dict[str, torch.Tensor]:
        raise AssertionError(f"tensors of {path} read before the header was checked")

    monkeypatch.setattr(lorsa_format, "load_safetensors", no_read)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(W_O|junk)"):
        load_lorsa(directory)


# --------------------------------------------------------------------------- sparse_coder_format
def test_a_bf16_sparse_coder_round_trips_in_bf16_bit_for_bit(tmp_path):
    """``model.safetensors`` holds the module's state dict as it is (module docstring), and a load without
    ``dtype`` gives the stored dtype: a bf16 skip transcoder comes back bf16, every tensor equal (mutant: the
    state cast to fp32 when saving)."""
    torch.manual_seed(0)
    tc = SkipTranscoder(TranscoderConfig(d_in=6, d_sae=12, d_out=6, activation="relu")).to(torch.bfloat16)
    with torch.no_grad():
        for p in tc.parameters():
            p.normal_()
    back = load_sparse_coder(save_sparse_coder(tc, tmp_path / "tc"))
    assert type(back) is SkipTranscoder
    want = tc.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == torch.bfloat16, key
        assert torch.equal(got[key], value), key


def _sae_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    out = save_sparse_coder(SparseAutoencoder(SAEConfig(d_in=4, d_sae=8, activation="relu")), tmp_path / "sae")
    (out / "checksums.json").unlink()
    return out


def test_a_sparse_coder_config_with_null_extra_loads_with_no_extra(tmp_path):
    """``"extra": null`` is no extra, as an absent key (``parse_config``; the Lorsa format's rule too)
    (mutant: null passed on to the config class, which refuses it)."""
    directory = _sae_dir(tmp_path)
    _edit_config(directory, {"extra": None})
    assert load_sparse_coder(directory).cfg.extra == {}


def test_a_sparse_coder_config_without_kind_is_refused(tmp_path):
    """``kind`` is part of the envelope (module docstring: one of four tags); a file without it is refused
    naming the key, not read as some default kind (mutant: ``"sae"`` by default)."""
    directory = _sae_dir(tmp_path)
    _edit_config(directory, {"kind": dataclasses.MISSING}, envelope=True)
    with pytest.raises(CheckpointError, match=r"config\.json.*'kind'"):
        load_sparse_coder(directory)


# --------------------------------------------------------------------------- lorsa_config
def test_the_default_attention_scale_is_the_square_root_of_the_qk_head_size(tmp_path):
    """``attn_scale`` defaults to ``sqrt(d_qk_head)`` (class docstring; the paper's scaled dot product), also for a
    ``config.json`` that leaves it out (mutant: ``sqrt(d_model)``)."""
    cfg = LorsaConfig(d_model=36, n_qk_heads=2, d_qk_head=9, n_ov_heads=4, top_k=2)
    assert cfg.scale == 3.0 and cfg.attn_scale == 3.0
    directory = _lorsa_dir(tmp_path)
    _edit_config(directory, {"attn_scale": dataclasses.MISSING})
    assert load_lorsa(directory).cfg.scale == pytest.approx(math.sqrt(4), rel=0, abs=0)


@pytest.mark.parametrize(("field", "value"), [
    ("layer", -1), ("use_decoder_bias", 1), ("use_decoder_bias", "false"), ("rotary", "half"),
])
def test_a_lorsa_config_field_out_of_its_rule_is_refused_in_code_and_on_disk(tmp_path, field, value):
    """The class's rules: ``layer`` an int >= 0 or None, ``use_decoder_bias`` a bool, ``rotary.head_dim ==
    d_qk_head``; the first and last from ``config.json`` too (mutants: ``layer < -1`` refused only;
    ``use_decoder_bias`` unchecked, so ``"false"`` built a decoder bias; a smaller rotary head accepted)."""
    kwargs = {"d_model": 8, "n_qk_heads": 2, "d_qk_head": 4, "n_ov_heads": 4, "top_k": 2}
    if field == "rotary":  # a rotary of another head size (half of d_qk_head): refused, not partly applied
        value = RotaryConfig(head_dim=2, rotary_dim=2)
    with pytest.raises(CheckpointError, match=field):
        cfg = LorsaConfig(**kwargs)  # type: ignore[arg-type]
        setattr(cfg, field, value)  # past the suite's type-checking wrapper of __init__: the class's own checks
        cfg.__post_init__()
    if field == "use_decoder_bias":  # from a file, the suite's type checker of __init__ would answer first
        return
    directory = _lorsa_dir(tmp_path)
    _edit_config(directory, {field: value.to_dict() if isinstance(value, RotaryConfig) else value})
    with pytest.raises(CheckpointError, match=r"config\.json.*" + field):
        load_lorsa(directory)


def test_from_mhsa_drops_the_cast_models_rounded_frequencies():
    """``from_mhsa``: the Lorsa keeps its own exact fp32 RoPE, ``inv_freq_dtype`` of a model cast to bf16 is
    dropped and every other RoPE field kept (its docstring) (mutant: the MHSA's rotary taken as it is)."""
    hf = tiny_hf_model("llama").to(torch.bfloat16)
    w = get_adapter(hf).mhsa_weights(hf, 1)
    assert w.rotary is not None and w.rotary.inv_freq_dtype == "bfloat16"  # the case this is about
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=2 * w.n_heads, top_k=2)
    assert cfg.rotary is not None and cfg.rotary.inv_freq_dtype is None
    assert dataclasses.asdict(cfg.rotary) == {**dataclasses.asdict(w.rotary), "inv_freq_dtype": None}


# --------------------------------------------------------------------------- llamascopium_sae
PEER_DEFAULTS = {"use_decoder_bias": True, "sparsity_include_decoder_norm": True, "top_k": 50}
"""Llamascopium's ``BaseSAEConfig`` defaults (``src/lm_saes/config.py``): what its loader uses when a key is absent."""


@pytest.mark.parametrize("key", sorted(PEER_DEFAULTS))
def test_an_absent_llamascopium_key_loads_as_the_peers_default(tmp_path, key):
    """A config without ``key`` is the same checkpoint as one with the peer's default written out (mutants: the
    reader's defaults changed: ``top_k`` 64, the decoder-norm gating off, no decoder bias)."""
    explicit, absent = tmp_path / "explicit", tmp_path / "absent"
    for d in (explicit, absent):
        shutil.copytree(PEERS / "sae_topk_inference", d)
    raw = json.loads((explicit / "config.json").read_text())
    raw[key] = PEER_DEFAULTS[key]
    if key == "top_k":  # 50 of d_sae = 64
        assert raw["d_model"] * raw["expansion_factor"] >= 50
    (explicit / "config.json").write_text(json.dumps(raw))
    del raw[key]
    (absent / "config.json").write_text(json.dumps(raw))
    want, got = load_llamascopium_sae(explicit), load_llamascopium_sae(absent)
    assert got.cfg.activation_params == want.cfg.activation_params
    assert got.state_dict().keys() == want.state_dict().keys()
    for name, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name


def test_a_bf16_llamascopium_sae_loads_in_its_stored_dtype():
    """``load_weights`` returns the folds "in our names and the stored dtype" (its docstring): a bf16 file gives a
    bf16 module, each tensor the fp64 fold of the stored one rounded once (mutant: every tensor fp32)."""
    stored = load_file(PEERS / "sae_bf16" / "sae_weights.safetensors")
    assert stored["W_E"].dtype == torch.bfloat16
    sae = load_llamascopium_sae(PEERS / "sae_bf16")
    assert {v.dtype for v in sae.state_dict().values()} == {torch.bfloat16}
    n = stored["W_D"].double().norm(dim=-1)  # "inference", decoder-norm gating: W_E[:, i] * n_i (module docstring)
    assert torch.equal(sae.W_enc, (stored["W_E"].double() * n).to(torch.bfloat16))


@pytest.mark.parametrize("folded", [False, True])
def test_a_llamascopium_sae_records_whether_the_load_folded_the_dataset_norm(folded):
    """``extra["llamascopium"]`` says what the load did: ``dataset_norm_folded_here`` and the scale factors
    ``sqrt(d_model) / dataset_average_activation_norm[hook]`` it folded (module docstring), none for folded
    weights (mutant: the flag inverted)."""
    directory = PEERS / "sae_relu_dataset-wise"
    sae = load_llamascopium_sae(directory, weights_folded=folded)
    info = sae.cfg.extra["llamascopium"]
    assert info["dataset_norm_folded_here"] is (not folded)
    stored = load_file(directory / "sae_weights.safetensors")
    prefix = "dataset_average_activation_norm."
    want = {} if folded else {k[len(prefix):]: math.sqrt(sae.cfg.d_in) / float(v)
                              for k, v in stored.items() if k.startswith(prefix)}
    assert info["scales"].keys() == want.keys()
    for hook, s in want.items():
        assert info["scales"][hook] == pytest.approx(s, rel=1e-6)
