"""Mutation probe, round 9 (docs/reliability.md): the device and dtype rule of ``_placement`` on the CPU dtypes and
the ``meta`` device. Each test was seen failing with a one-line mutant the default tests let through; the reference
is the rule the module's docstrings state, checked with plain torch modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnsight_lorsa._placement import f32, host_f32, like, place, placement, to_module
from nnsight_lorsa.errors import PlacementError


class _Mixed(nn.Module):
    """An integer parameter registered first (a lookup table), then the floating weight."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(3), requires_grad=False)
        self.w = nn.Parameter(torch.ones(2, 2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_placement_takes_the_dtype_of_the_first_floating_parameter(dtype):
    m = _Mixed(dtype)
    assert placement(m) == (torch.device("cpu"), dtype)
    assert to_module(torch.ones(2, dtype=torch.float32), m).dtype == dtype


def test_place_refuses_a_module_partly_on_meta_even_where_the_rest_is_on_the_target():
    m = nn.Linear(2, 2)
    m.bias = nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(PlacementError, match="meta"):
        place(m, torch.device("cpu"), "layer 0 attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_f32_and_host_f32_widen_to_at_least_fp32(dtype):
    x = torch.tensor([1.0, 1.0 + 2.0 ** -7], dtype=dtype)
    assert f32(x).dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(f32(x).double(), x.double())  # nothing rounded on the way
    h = host_f32(x)
    assert h.dtype == torch.float32 and h.device.type == "cpu" and not h.requires_grad


def test_to_module_keeps_integer_inputs_integer():
    m = nn.Linear(2, 2).to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3]])
    out = to_module(ids, m)
    assert out.dtype == torch.int64 and torch.equal(out, ids)


def test_to_module_passes_an_inf_through_and_refuses_only_finite_values_past_the_range():
    """``past_range``: the cast is refused for *finite* values that would become inf; an ``inf`` (or NaN) already
    there is not made by the cast and goes through as it is."""
    m = nn.Linear(2, 2).to(torch.float16)
    out = to_module(torch.tensor([1.0, torch.inf, -torch.inf, 7.0e4 / 2]), m)
    assert out.dtype == torch.float16 and torch.isinf(out[1:3]).all() and out[0] == 1
    with pytest.raises(PlacementError, match="7e\\+04"):
        to_module(torch.tensor([1.0, torch.inf, 7.0e4]), m)


def test_like_casts_tensors_to_the_reference_dtype_and_keeps_numbers():
    ref = torch.zeros(2, dtype=torch.bfloat16)
    assert like([1.5, 2.5], ref).dtype == torch.bfloat16
    assert like(torch.tensor([1, 2]), ref).dtype == torch.bfloat16
    assert like(0.5, ref) == 0.5 and isinstance(like(0.5, ref), float)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn], ids=str)
def test_check_dtype_arg_refuses_every_dtype_a_module_cannot_compute_in(dtype):
    from nnsight_lorsa._placement import MODULE_DTYPES, check_dtype_arg
    from nnsight_lorsa.errors import ArgumentError

    assert all(check_dtype_arg(d, "load") is d for d in MODULE_DTYPES)
    with pytest.raises(ArgumentError, match="load: dtype must be"):
        check_dtype_arg(dtype, "load")


def test_placement_of_a_module_partly_on_meta_says_meta():
    m = nn.Linear(2, 2)
    m.bias = nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(PlacementError, match="meta device"):
        placement(m, "the Lorsa at layer 3")


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="needs a machine without an accelerator index 7")
def test_a_missing_accelerator_index_is_a_placement_error_not_an_argument_error():
    from nnsight_lorsa._placement import check_device_arg

    with pytest.raises(PlacementError, match="not available here|cannot put tensors"):
        check_device_arg(7, "load")
