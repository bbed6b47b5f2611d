"""The set index ``set.json`` (``ReplacementSet.save``, since 2026-11-28; ``formats/hub.py``): a local copy of a saved
set that lacks a folder, or whose folder lost its weights, loaded as a smaller set (a missing folder silently; a torn
one with only a ``PartialLoadWarning``); now ``from_pretrained`` refuses it, naming the folder and the index."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from helpers import generated, make_lorsa, make_transcoder, tiny_llama_shared
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, TranscoderSet
from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.formats.hub import SET_INDEX_FORMAT, set_index_folders
from nnsight_lorsa.formats.registry import PartialLoadWarning

tiny = tiny_llama_shared


def saved(tmp_path, layers=(1, 2)):
    model, hf, adapter = tiny()
    lorsas = LorsaSet(model, {i: make_lorsa(hf, adapter, i, seed=i) for i in layers})
    lorsas.save(tmp_path / "set")
    return model, lorsas, tmp_path / "set"


def same(a: LorsaSet, b: LorsaSet) -> bool:
    return list(a) == list(b) and all(
        all(torch.equal(x, y) for x, y in zip(a[k].state_dict().values(), b[k].state_dict().values(), strict=True))
        for k in a)


def test_a_copy_missing_a_folder_is_refused_not_a_smaller_set(tmp_path):
    model, lorsas, d = saved(tmp_path)
    assert set_index_folders(d) == ["layer_1", "layer_2"]
    assert same(LorsaSet.from_pretrained(model, d), lorsas)
    shutil.rmtree(d / "layer_2")  # seen failing before the index: LorsaSet of layer 1 only, no warning
    with pytest.raises(CheckpointError, match=r"set\.json\) lists the folders \['layer_1', 'layer_2'\], but "
                                              r"\['layer_2'\] are missing from the directory .*partial copy"):
        LorsaSet.from_pretrained(model, d)


def test_a_listed_folder_that_does_not_load_is_refused(tmp_path):
    model, _, d = saved(tmp_path)
    (d / "layer_2" / "model.safetensors").unlink()  # seen failing: a PartialLoadWarning and layer 1 only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match=r"lists the folders .* these did not load: layer_2: \w*Error"):
            LorsaSet.from_pretrained(model, d)
    for f in (d / "layer_2").iterdir():  # the folder left empty
        f.unlink()
    with pytest.raises(CheckpointError, match=r"\['layer_2'\] hold no checkpoint files"):
        LorsaSet.from_pretrained(model, d)


def test_saves_into_one_directory_accumulate_and_a_directory_without_an_index_loads_as_before(tmp_path):
    model, hf, adapter = tiny()
    model, first, d = saved(tmp_path, layers=(1,))
    second = LorsaSet(model, {2: make_lorsa(hf, adapter, 2, seed=7)})
    second.save(d)  # the folders of keys this set does not hold are kept: the index lists them too
    assert set_index_folders(d) == ["layer_2", "layer_1"]
    loaded = LorsaSet.from_pretrained(model, d)
    assert same(loaded, LorsaSet(model, {1: first[1], 2: second[2]}))
    again = LorsaSet(model, {1: make_lorsa(hf, adapter, 1, seed=3)})
    again.save(d)  # overwrites layer_1, keeps layer_2
    assert sorted(set_index_folders(d) or []) == ["layer_1", "layer_2"]
    assert same(LorsaSet.from_pretrained(model, d), LorsaSet(model, {1: again[1], 2: second[2]}))
    (d / "set.json").unlink()  # saved before the index (or built by hand): read as it is
    shutil.rmtree(d / "layer_1")
    assert list(LorsaSet.from_pretrained(model, d)) == [2]


def test_an_unlisted_folder_that_fails_only_warns_and_transcoder_sets_are_indexed(tmp_path):
    model, lorsas, d = saved(tmp_path)
    (d / "layer_5").mkdir()
    (d / "layer_5" / "config.json").write_text("{}")  # copied in by hand beside the set, broken
    with pytest.warns(PartialLoadWarning, match="layer_5"):
        assert same(LorsaSet.from_pretrained(model, d), lorsas)
    tcs = TranscoderSet(model, {0: make_transcoder(layer=0), 1: make_transcoder(layer=1, seed=1)})
    tcs.save(tmp_path / "tcs")
    assert set_index_folders(tmp_path / "tcs") == ["layer_0", "layer_1"]
    shutil.rmtree(tmp_path / "tcs" / "layer_0")
    with pytest.raises(CheckpointError, match=r"\['layer_0'\] are missing"):
        TranscoderSet.from_pretrained(model, tmp_path / "tcs")


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)
_INDEXES = st.one_of(
    _JSON,
    st.fixed_dictionaries({"format": st.just(SET_INDEX_FORMAT), "folders": _JSON}),
    st.fixed_dictionaries({"format": st.just(SET_INDEX_FORMAT),
                           "folders": st.lists(st.sampled_from(["layer_1", "layer_2", "", " layer_1", "/abs", "../up",
                                                                "a/../b", "x\\y", "."]), max_size=4)}),
)


@generated(examples=25, sweep=300, data=st.data())
def test_a_malformed_set_index_is_a_checkpoint_error_naming_it(tmp_path_factory, data):
    """Any JSON (or not JSON) in ``set.json``: the listed folders back, or a ``CheckpointError`` naming the file."""
    model, _, d = saved(tmp_path_factory.mktemp("idx"))
    value = data.draw(_INDEXES | st.binary(max_size=12).map(lambda b: b"\xff" + b))
    (d / "set.json").write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())
    try:
        folders = set_index_folders(d)
    except CheckpointError as e:
        assert "set.json" in str(e)
        with pytest.raises(CheckpointError, match="set.json"):
            LorsaSet.from_pretrained(model, d)
        return
    assert isinstance(value, dict) and folders == value["folders"]
    assert all(f and ".." not in f.split("/") and not f.startswith("/") for f in folders)
    if set(folders) <= {"layer_1", "layer_2", "."}:  # "." is a module at the top (a CLT's): not checked here
        assert list(LorsaSet.from_pretrained(model, d)) == [1, 2]
    else:
        with pytest.raises(CheckpointError, match="lists the folders"):
            LorsaSet.from_pretrained(model, d)
