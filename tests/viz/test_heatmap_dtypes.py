"""Heatmap details of the graph viewer (``render_html(details=...)``) from tensors of any dtype and device
(issue 21): bf16 / fp16 / fp64 values are shown as their fp32 values (NaN as empty cells); a complex tensor
(whose imaginary part the cast to fp32 dropped with only torch's warning), a bool or a ``meta`` tensor (torch's
own "Cannot copy out of meta tensor"), a shape that is no matrix, or labels that do not fit are the package's
ArgumentError (a ValueError, as before) naming the heatmap."""

from __future__ import annotations

import pytest
import torch

from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.viz.graph_viewer import normalize_details


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_a_heatmap_in_any_float_dtype_shows_its_values(dtype):
    v = (torch.arange(6, dtype=torch.float64).reshape(2, 3) / 7).to(dtype)
    v[1, 2] = float("nan")
    (block,) = normalize_details({"n": {"heatmap": v, "rows": ["a", "b"], "cols": ["x", "y", "z"]}})["n"]
    want = v.float()
    assert block["values"][1][2] is None
    assert [x for row in block["values"] for x in row][:5] == want.flatten()[:5].tolist()


@pytest.mark.parametrize("bad", [torch.ones(2, 2, dtype=torch.complex64), torch.ones(2, 2, dtype=torch.bool),
                                 torch.ones(2, 2, device="meta"), torch.ones(2, 2, 2)],
                         ids=["complex", "bool", "meta", "3d"])
def test_a_heatmap_that_cannot_be_shown_is_an_argument_error(bad):
    with pytest.raises(ArgumentError, match="heatmap"):
        normalize_details({"n": {"heatmap": bad}})
    with pytest.raises(ArgumentError, match="heatmap"):
        normalize_details({"n": bad})


def test_heatmap_labels_that_do_not_fit_are_an_argument_error():
    with pytest.raises(ArgumentError, match="heatmap labels"):
        normalize_details({"n": {"heatmap": torch.ones(2, 3), "rows": ["a"]}})
