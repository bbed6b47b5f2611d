"""Mutation probe round 9c (``nnsight_lorsa/formats/files.py``): what survived the format and hub tests.

* ``read_yaml_object`` of an empty file is ``{}`` (its docstring);
* under ``headers_only`` a safetensors file's tensors have the dtype and shape a full read gives them
  (``safetensors.torch.load_file``, the reference), every tensor of more than one element is an empty ``meta``
  tensor, and a scalar or a one-element tensor is read with its value (the docstring: the dataset-norm factors a
  reader checks and folds).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nnsight_lorsa.formats.files import headers_only, load_safetensors, read_yaml_object


@pytest.mark.parametrize("text", ["", "\n", "# a comment only\n"])
def test_an_empty_yaml_file_is_an_empty_mapping(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    assert read_yaml_object(path) == {}


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def test_a_headers_only_read_has_the_full_reads_dtypes_and_shapes(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {f"t{i}": (torch.arange(6).reshape(2, 3) % 2).to(dtype) for i, dtype in enumerate(DTYPES)}
    save_file(tensors, str(path))
    full = load_file(str(path))
    with headers_only():
        meta = load_safetensors(path)
    assert set(meta) == set(full)
    for k, t in full.items():
        assert (meta[k].dtype, tuple(meta[k].shape), meta[k].device.type) == (t.dtype, tuple(t.shape), "meta"), k


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_headers_only_read_reads_one_element_tensors(tmp_path, shape):
    path = tmp_path / "t.safetensors"
    save_file({"norm": torch.full(shape, 3.25), "w": torch.ones(2, 2)}, str(path))
    with headers_only():
        out = load_safetensors(path)
    assert out["w"].is_meta
    assert not out["norm"].is_meta and tuple(out["norm"].shape) == shape and float(out["norm"].sum()) == 3.25


@pytest.mark.parametrize(("given", "folder"), [("./a/./b/", "a/b"), ("a//b", "a/b"), (".", None), ("./", None),
                                               ("", None), (None, None)])
def test_a_hub_subfolder_is_spelled_as_the_repos_paths(given, folder):
    """``_repo_folder``'s docstring: ``a/./b/`` is ``a/b``; ``""`` or ``"."`` the repo's top (the download patterns
    match the repo's paths as strings: ``./a/x`` would match nothing)."""
    from nnsight_lorsa.formats.files import _repo_folder

    assert _repo_folder("me/repo", given) == folder
