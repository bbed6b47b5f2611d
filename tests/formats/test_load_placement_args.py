"""``device=`` / ``dtype=`` of every loader (``formats.load`` / ``load_all``, the sets' ``from_pretrained``,
``envoy.load_model``): a dtype a module cannot compute in, or a device torch cannot put tensors on here, is
refused by a named error before anything is read, not by torch's or transformers' own error from deep in a
build (and ``dtype="bfloat16"`` is not read as a device string); a cast that overflows a stored value is
refused, naming the file and the tensor, instead of loading an ``inf`` weight. ``save`` of a module on ``meta``
(nothing to write) is a PlacementError, not torch's own error."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sae
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, SAESet, TranscoderSet
from nnsight_lorsa.assets import default_lorsa_dir, default_transcoder_dir
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.errors import ArgumentError, CheckpointError, PlacementError
from nnsight_lorsa.formats import load, load_all, save

#: the dtypes a module computes in (its forward's matmuls run in them on every device)
MODULE_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
ALL_DTYPES = sorted((getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)), key=str)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("sae")
    save(make_sae(), d / "sae")
    return d


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.one_of(st.sampled_from(ALL_DTYPES), st.sampled_from(["bfloat16", "float16", "fp32", 3, 1.5, True])))
def test_load_takes_only_the_dtypes_a_module_computes_in(ckpt, dtype):
    if isinstance(dtype, torch.dtype) and dtype in MODULE_DTYPES:
        module = load(ckpt / "sae", dtype=dtype)
        assert {p.dtype for p in module.parameters()} == {dtype}
        return
    with pytest.raises(ArgumentError, match="dtype"):
        load(ckpt / "sae", dtype=dtype)
    with pytest.raises(ArgumentError, match="dtype"):
        load_all(ckpt, dtype=dtype)


@pytest.mark.parametrize("device", ["nonsense", "cpu:x", 1.5, True, object()])
def test_load_refuses_what_is_not_a_device(ckpt, device):
    with pytest.raises(ArgumentError, match="device"):
        load(ckpt / "sae", device=device)
    with pytest.raises(ArgumentError, match="device"):
        load_all(ckpt, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 0), 0])
def test_load_onto_a_device_this_machine_lacks_is_a_placement_error(ckpt, device):
    with pytest.raises(PlacementError, match="cuda"):
        load(ckpt / "sae", device=device)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_load_onto_a_usable_device_works(ckpt, device):
    module = load(ckpt / "sae", device=device)
    assert {p.device for p in module.parameters()} == {torch.device(device)}


def test_from_pretrained_refuses_a_bad_dtype_or_device_by_name():
    model = load_model()
    for cls, src in ((LorsaSet, default_lorsa_dir()), (TranscoderSet, default_transcoder_dir())):
        for dtype in (torch.int32, "bfloat16", torch.complex64):
            with pytest.raises(ArgumentError, match="dtype"):
                cls.from_pretrained(model, src, dtype=dtype)
        with pytest.raises(ArgumentError, match="device"):
            cls.from_pretrained(model, src, device="nonsense")


def test_load_model_refuses_a_bad_dtype_or_device_by_name():
    for dtype in (torch.int32, torch.bool, "float32"):
        with pytest.raises(ArgumentError, match="dtype"):
            load_model(dtype=dtype)
    with pytest.raises(ArgumentError, match="device"):
        load_model(device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(PlacementError, match="cuda"):
            load_model(device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_cast_that_overflows_a_stored_weight_is_refused_naming_it(tmp_path, dtype):
    """fp16 holds |v| <= 65504: an fp32 file with a larger weight loaded in fp16 would hold ``inf``
    (and the module compute NaN); bf16 has fp32's range and loads it."""
    sae = make_sae(d_in=128)  # the embedded model's width
    with torch.no_grad():
        sae.b_dec[3] = 1e5
    save(sae, tmp_path / "big")
    if dtype == torch.float16:
        with pytest.raises(CheckpointError, match=r"b_dec.*float16"):
            load(tmp_path / "big", dtype=dtype)
        model = load_model(dtype=torch.float16)
        with pytest.raises(CheckpointError, match=r"b_dec.*float16"):
            SAESet.from_pretrained(model, {"model.layers.1": tmp_path / "big"})
    else:
        module = load(tmp_path / "big", dtype=dtype)
        assert bool(torch.isfinite(module.b_dec).all())


def _meta_objects():
    from helpers import make_clt, make_transcoder

    from nnsight_lorsa.formats.circuit_tracer import CircuitTracerTranscoders

    tcs = {layer: make_transcoder(skip=False, activation="jumprelu", activation_params={}, layer=layer)
           for layer in (0, 1)}
    return [
        ("nnsight_lorsa", lambda: make_sae().to("meta"), {}),
        ("saelens", lambda: make_sae().to("meta"), {"hook_name": "blocks.1.hook_resid_post"}),
        ("sparsify", lambda: make_sae(activation="topk", activation_params={"k": 4}).to("meta"), {}),
        ("circuit_tracer", lambda: make_clt().to("meta"), {}),
        ("circuit_tracer", lambda: {k: v.to("meta") if k == 1 else v for k, v in tcs.items()}, {}),
        ("circuit_tracer", lambda: CircuitTracerTranscoders({k: v.to("meta") for k, v in tcs.items()}), {}),
    ]


@pytest.mark.parametrize(("fmt", "make", "options"), _meta_objects())
def test_saving_a_module_on_the_meta_device_is_a_placement_error(tmp_path, fmt, make, options):
    """A module whose weights were never materialised (``meta``) has nothing to write: ``save`` says so
    (PlacementError naming it) before anything is written, not torch's "Cannot copy out of meta tensor"."""
    with pytest.raises(PlacementError, match="meta"):
        save(make(), tmp_path / "out", format=fmt, **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_gates_refuse_a_dtype_they_are_not_loaded_in(tmp_path, dtype):
    """Sparse-attention gates are fp32 (they compute in fp32 whatever the model's dtype): ``load(..., dtype=bf16)``
    returned fp32 gates, the argument silently not honoured. It is refused; None and fp32 load them."""
    from helpers import tiny_hf_model

    from nnsight_lorsa.sparse_attention import install_gated_attention
    from nnsight_lorsa.sparse_attention.io import save_gates

    hf = tiny_hf_model("llama")
    install_gated_attention(hf, init_bias=3.3)
    save_gates(hf, tmp_path)
    with pytest.raises(ArgumentError, match=r"fp32.*dtype"):
        load(tmp_path, format="sparse_attention", dtype=dtype)
    for ok in (None, torch.float32):
        gates = load(tmp_path, format="sparse_attention", dtype=ok)
        assert {p.dtype for g in gates.gates.values() for p in g.parameters()} == {torch.float32}


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _restored(tmp_path, fmt, name, dtypes):
    """A checkpoint in ``fmt`` whose tensors are rewritten in the dtypes ``dtypes`` draws (by key order); its
    checksum manifest dropped (the file is changed on purpose). Returns the directory and the stored tensors."""
    from helpers import make_lorsa, make_transcoder, tiny_hf_model
    from safetensors.torch import load_file, save_file

    from nnsight_lorsa import get_adapter

    if fmt == "lorsa":
        hf = tiny_hf_model("llama")
        obj, options, fmt_name = make_lorsa(hf, get_adapter(hf)), {}, "nnsight_lorsa"
    elif fmt == "sae":
        obj, options, fmt_name = make_sae(), {}, "nnsight_lorsa"
    elif fmt == "saelens":
        obj, options, fmt_name = make_sae(), {"hook_name": "blocks.1.hook_resid_post"}, "saelens"
    else:
        obj, options, fmt_name = make_transcoder(skip=False, activation="topk", activation_params={"k": 4}), {}, \
            "sparsify"
    d = tmp_path / name
    save(obj, d, format=fmt_name, **options)
    (file,) = [f for f in d.iterdir() if f.suffix == ".safetensors"]
    stored = load_file(str(file))
    keys = sorted(k for k, v in stored.items() if v.is_floating_point())
    stored = {k: (v.to(dtypes[keys.index(k) % len(dtypes)]) if k in keys else v) for k, v in stored.items()}
    save_file(stored, str(file))
    (d / "checksums.json").unlink(missing_ok=True)
    return d, {k: stored[k] for k in keys}


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["lorsa", "sae", "saelens", "sparsify"]),
       dtypes=st.lists(st.sampled_from(FLOATS), min_size=1, max_size=4),
       asked=st.sampled_from([None, *FLOATS]))
def test_a_checkpoint_stored_in_several_dtypes_loads_in_the_widest_unless_told(tmp_path_factory, fmt, dtypes, asked):
    """The default dtype is the stored one: for tensors stored in several dtypes, the widest of them
    (``torch.promote_types``: bf16 with fp16 is fp32), so that every stored value loads exactly — the loaders
    took the main weight's dtype (``W_Q`` / ``W_enc``) and rounded every other tensor to it with no word (an fp64
    ``W_O`` under a bf16 ``W_Q``: 2e-3 relative). ``dtype=`` casts every tensor to it, each rounded once."""
    d, stored = _restored(tmp_path_factory.mktemp("mixed"), fmt, "ckpt", dtypes)
    widest = stored[next(iter(stored))].dtype
    for v in stored.values():
        widest = torch.promote_types(widest, v.dtype)
    want = widest if asked is None else asked
    big = max(float(v.double().abs().max()) for v in stored.values())
    module = load(d, dtype=asked)
    assert {p.dtype for p in module.parameters()} == {want}
    if fmt not in ("lorsa", "sae"):  # the other formats fold or convert: the dtype is the claim there
        return
    got = module.state_dict()
    for k, v in stored.items():  # each value exactly as stored, or rounded once to dtype=
        assert torch.equal(got[k].double(), v.to(want).double()), (k, v.dtype, want)
    assert big < 65504  # no overflow case hides here (that is the test above)
