"""Issue 23, class 8: our own format's loaders refuse what they used to trust — an ``architecture`` that is no
adapter family (``"../../x"``), an ``extra`` that is not a mapping, a ``"version": true`` (``True == 1`` in
Python), and layer names that ``int()`` reads but that are not ``layer_<ASCII digits>`` (``layer_ 2``,
``layer_+2``, ``layer_٢``). Generated configs (hypothesis) and the probe's explicit cases."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
from helpers import make_lorsa, tiny_nnsight
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.errors import CheckpointError, ConfigMismatchError
from nnsight_lorsa.formats import circuit_tracer
from nnsight_lorsa.formats.lorsa_format import load_lorsa, save_lorsa
from nnsight_lorsa.formats.sparse_coder_format import load_sparse_coder, save_sparse_coder
from nnsight_lorsa.formats.validate import adapter_families, layer_of_name, looks_like_layer_name
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

#: JSON values of every type (a generated config field)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def lorsa_dir(tmp_path_factory) -> Path:
    cfg = LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=8, n_ov_heads=8, top_k=2, layer=1, architecture="llama",
                      extra={"note": "x"})
    return save_lorsa(Lorsa(cfg).eval(), tmp_path_factory.mktemp("lorsa") / "ckpt")


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory) -> Path:
    return save_sparse_coder(SparseAutoencoder(SAEConfig(d_in=8, d_sae=16)), tmp_path_factory.mktemp("sae") / "ckpt")


def _unchecked(cls, **kwargs):
    """``cls(**kwargs)`` through the dataclass's own ``__init__``, unwrapped from the test-time type hook
    (``tests/conftest.py``): wrongly typed values reach our checks as they do for a user."""
    obj = cls.__new__(cls)
    inspect.unwrap(cls.__init__)(obj, **kwargs)
    return obj


def _edit(src: Path, dst: Path, edit) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    (dst / "checksums.json").unlink()  # edited on purpose: the loaders' own checks must refuse it
    doc = json.loads((dst / "config.json").read_text())
    edit(doc)
    (dst / "config.json").write_text(json.dumps(doc))
    return dst


# ------------------------------------------------------------------ explicit cases of the probe
@pytest.mark.parametrize("arch", ["../../x", "/etc/passwd", "", "LLAMA", "llama ", 3, True, ["llama"], {"a": 1}])
def test_lorsa_architecture_must_be_an_adapter_family_or_null(lorsa_dir, tmp_path, arch):
    d = _edit(lorsa_dir, tmp_path / "c", lambda doc: doc["config"].update(architecture=arch))
    with pytest.raises(CheckpointError, match=r"config\.json: key 'config\.architecture' is"):
        load_lorsa(d)


@pytest.mark.parametrize("arch", sorted(adapter_families()) + [None])
def test_lorsa_architecture_family_names_and_null_load(lorsa_dir, tmp_path, arch):
    d = _edit(lorsa_dir, tmp_path / "c", lambda doc: doc["config"].update(architecture=arch))
    assert load_lorsa(d).cfg.architecture == arch


@pytest.mark.parametrize("extra", ["x", 3, True, ["a"], 1.5])
def test_extra_must_be_a_mapping(lorsa_dir, sae_dir, tmp_path, extra):
    d = _edit(lorsa_dir, tmp_path / "l", lambda doc: doc["config"].update(extra=extra))
    with pytest.raises(CheckpointError, match=r"config\.json: key 'extra' must be a JSON object"):
        load_lorsa(d)
    d = _edit(sae_dir, tmp_path / "s", lambda doc: doc["config"].update(extra=extra))
    with pytest.raises(CheckpointError, match=r"config\.json: key 'extra' must be a JSON object"):
        load_sparse_coder(d)
    with pytest.raises(CheckpointError, match="extra must be a mapping"):  # constructed by a user too
        _unchecked(SAEConfig, d_in=8, d_sae=16, extra=extra)
    with pytest.raises(CheckpointError, match="extra must be a mapping"):
        _unchecked(LorsaConfig, d_model=16, n_qk_heads=2, d_qk_head=8, n_ov_heads=8, top_k=2, extra=extra)


@pytest.mark.parametrize("version", [True, 1.0, "1", [1], 2, 0, None])
def test_version_must_be_the_int_1(lorsa_dir, sae_dir, tmp_path, version):
    for src, load in ((lorsa_dir, load_lorsa), (sae_dir, load_sparse_coder)):
        d = _edit(src, tmp_path / "v", lambda doc: doc.update(version=version))
        with pytest.raises(CheckpointError, match=r"config\.json: key 'version' is"):
            load(d)


def test_unmodified_checkpoints_still_load(lorsa_dir, sae_dir):
    assert load_lorsa(lorsa_dir).cfg.extra == {"note": "x"}
    assert isinstance(load_sparse_coder(sae_dir), SparseAutoencoder)


# ------------------------------------------------------------------ generated configs
@SETTINGS
@given(key=st.sampled_from(["architecture", "extra"]), value=JSON_VALUES)
def test_generated_lorsa_config_fields_load_or_raise_named(lorsa_dir, tmp_path, key, value):
    d = _edit(lorsa_dir, tmp_path / "g", lambda doc: doc["config"].update({key: value}))
    valid = (value is None or (isinstance(value, str) and value in adapter_families())) if key == "architecture" else (
        value is None or isinstance(value, dict))
    if valid:
        cfg = load_lorsa(d).cfg
        assert getattr(cfg, key) == ({} if key == "extra" and value is None else value)
    else:
        with pytest.raises(CheckpointError, match=rf"config\.json: key '(config\.)?{key}'"):
            load_lorsa(d)


@SETTINGS
@given(value=JSON_VALUES)
def test_generated_versions_load_only_for_the_int_1(lorsa_dir, sae_dir, tmp_path, value):
    for src, load in ((lorsa_dir, load_lorsa), (sae_dir, load_sparse_coder)):
        d = _edit(src, tmp_path / "gv", lambda doc: doc.update(version=value))
        if type(value) is int and value == 1:
            load(d)
        else:
            with pytest.raises(CheckpointError, match=r"config\.json: key 'version' is"):
                load(d)


# ------------------------------------------------------------------ layer names
ODD_LAYER_NAMES = ["layer_ 2", "layer_+2", "layer_2 ", "layer_\u0662", "layer_2_", "layer_-2", "layer_1_0", "layer_²"]


@pytest.mark.parametrize("name", ODD_LAYER_NAMES)
def test_only_layer_digits_names_a_layer(name):
    assert layer_of_name(name) is None and looks_like_layer_name(name)
    assert layer_of_name(name + ".safetensors", ".safetensors") is None


@given(st.text(max_size=8))
def test_generated_layer_names(rest):
    name = "layer_" + rest
    expected = int(rest) if rest and all(c in "0123456789" for c in rest) else None
    assert layer_of_name(name) == expected
    if expected is None and any(c.isdigit() for c in rest):
        assert looks_like_layer_name(name)


@pytest.fixture(scope="module")
def lorsa_set_dir(tmp_path_factory):
    from nnsight_lorsa import LorsaSet, get_adapter

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    d = tmp_path_factory.mktemp("set") / "lorsas"
    LorsaSet(model, {1: make_lorsa(hf, adapter, 1)}).save(d)
    return model, d


@pytest.mark.parametrize("name", ["layer_ 2", "layer_+2", "layer_\u0662"])
def test_a_set_folder_that_is_not_layer_digits_is_refused(lorsa_set_dir, tmp_path, name):
    from nnsight_lorsa import LorsaSet

    model, d = lorsa_set_dir
    odd = tmp_path / "odd"
    shutil.copytree(d, odd)
    (odd / "layer_1").rename(odd / name)
    with pytest.raises(CheckpointError, match=r"set\.json\) lists the folders \['layer_1'\], but \['layer_1'\] are "
                       "missing"):  # the set index lists the folder its save wrote
        LorsaSet.from_pretrained(model, odd)
    (odd / "set.json").unlink()  # a directory built by hand (or saved before the set index)
    with pytest.raises(ConfigMismatchError, match=r"is not a layer folder name: only layer_<digits>"):
        LorsaSet.from_pretrained(model, odd)
    assert list(LorsaSet.from_pretrained(model, d)) == [1]


@pytest.mark.parametrize("listed", [True, False])
def test_circuit_tracer_layer_files_must_be_layer_digits(tmp_path, listed):
    tcs = {i: Transcoder(TranscoderConfig(d_in=8, d_sae=16, layer=i)) for i in range(2)}
    d = circuit_tracer.save_circuit_tracer_transcoders(tcs, tmp_path / "ct")
    (d / "checksums.json").unlink()
    (d / "layer_1.safetensors").rename(d / "layer_\u0661.safetensors")
    yaml = (d / "config.yaml").read_text(encoding="utf-8")
    if listed:  # the config lists the file: its layer is read from its name (our writer lists none: added here)
        yaml += "transcoders:\n- layer_0.safetensors\n- layer_\u0661.safetensors\n"
        match = r"config\.yaml: key 'transcoders'\[1\] is 'layer_\u0661\.safetensors'; a layer file is named"
    else:  # no list: the folder's layer_<i> files
        yaml = yaml.split("transcoders:")[0]
        match = r"not named layer_<digits>\.safetensors"
    (d / "config.yaml").write_text(yaml, encoding="utf-8")
    with pytest.raises(CheckpointError, match=match):
        circuit_tracer.load_circuit_tracer_transcoders(d)
