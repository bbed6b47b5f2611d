"""Every set's ``from_pretrained`` refuses a folder holding another kind of replacement with a named
``ConfigMismatchError`` that names the kind found (``holds a CrossLayerTranscoder``), for every pair of kinds, from a
local folder written by ``formats.save`` (until now a CLT read into a ``TranscoderSet`` was refused only through the
Hub test); each folder loads into its own kind's set with the weights saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_clt, make_lorsa, make_sae, make_transcoder, same_weights, tiny_nnsight

from nnsight_lorsa import CLTSet, LorsaSet, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.formats import save

SETS = {"lorsa": LorsaSet, "transcoder": TranscoderSet, "sae": SAESet, "clt": CLTSet}
CLASS = {"lorsa": "Lorsa", "transcoder": "SkipTranscoder", "sae": "SparseAutoencoder", "clt": "CrossLayerTranscoder"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    root = tmp_path_factory.mktemp("kinds")
    modules = {"lorsa": make_lorsa(hf, adapter, 1), "transcoder": make_transcoder(), "sae": make_sae(),
               "clt": make_clt()}
    paths = {"lorsa": root / "lorsa" / "layer_1", "transcoder": root / "transcoder" / "layer_1",
             "sae": root / "sae" / "model.layers.1", "clt": root / "clt"}
    for kind, module in modules.items():
        save(module, paths[kind])
    return model, modules, paths


@pytest.mark.parametrize("found", sorted(SETS))
@pytest.mark.parametrize("wanted", sorted(SETS))
def test_a_folder_of_another_kind_is_refused_by_name(folders: tuple, wanted: str, found: str) -> None:
    model, modules, paths = folders
    # a set folder (``layer_1/`` inside) for the per-layer and SAE sets; a CLT set reads one checkpoint folder
    source: Path = paths[found] if "clt" in (found, wanted) else paths[found].parent
    if wanted == found:
        loaded = SETS[wanted].from_pretrained(model, source, dtype=torch.float32)
        module = loaded.clt if wanted == "clt" else next(iter(loaded.values()))
        assert type(module).__name__ == CLASS[found] and same_weights(module, modules[found])
        return
    with pytest.raises(ConfigMismatchError, match=rf"holds a {CLASS[found]}\b"):
        SETS[wanted].from_pretrained(model, source)
