"""Host memory of loading, saving, converting and initialising big modules (issue 21 goal 3; the memx probe).

Default run: the mechanisms, on small modules — every writer streams its tensor files from the tensors'
memory (``safetensors.torch.save_file``; never the in-memory ``save``, which held the whole file and its two
halves again: 2x a module), and the load's NaN/inf check examines slices of at most ``FINITE_CHUNK`` elements
(``torch.isfinite`` of a whole tensor made ~1.5x that tensor in temporaries: 0.75x a Lorsa), counting exactly
what a plain whole-tensor count does. Slow: the peak resident memory above the baseline (``VmHWM`` after
``clear_refs``), each path in a fresh interpreter on a ~200 MB module, as a multiple of the module's size
(table in docs/reliability.md, "Host memory probe").
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_transcoder

from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.formats import load, save
from nnsight_lorsa.formats import validate as V

WRITERS: list[tuple[str, str, dict[str, Any]]] = [
    ("lorsa", "nnsight_lorsa", {}),
    ("lorsa", "llamascopium", {"hook_point_in": "blocks.0.ln1.hook_normalized",
                                "hook_point_out": "blocks.0.hook_attn_out"}),
    ("relu", "nnsight_lorsa", {}),
    ("relu", "saelens", {"hook_name": "blocks.0.ln2.hook_normalized"}),
    ("topk", "sparsify", {}),
    ("relu_set", "circuit_tracer", {"feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out"}),
]


def _module(kind: str) -> Any:
    if kind == "lorsa":
        lorsa = Lorsa(LorsaConfig(d_model=32, n_qk_heads=4, d_qk_head=8, n_ov_heads=64, top_k=8))
        with torch.no_grad():
            lorsa.b_V.normal_()
        return lorsa
    if kind == "relu_set":
        return {i: make_transcoder(False, activation="relu", activation_params={}, layer=i) for i in (0, 1)}
    return make_transcoder(False, activation=kind, activation_params={"k": 4} if kind == "topk" else {})


def _state(obj: Any) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict) or hasattr(obj, "transcoders"):
        items = obj.items() if isinstance(obj, dict) else obj.transcoders.items()
        return {f"{i}.{k}": v for i, m in items for k, v in m.state_dict().items()}
    return dict(obj.state_dict())


@pytest.mark.parametrize("kind,fmt,kw", WRITERS, ids=[f"{k}-{f}" for k, f, _ in WRITERS])
def test_writers_stream_tensor_files_without_an_in_memory_copy(tmp_path: Path, monkeypatch: Any, kind: str,
                                                                fmt: str, kw: dict[str, Any]) -> None:
    import safetensors.torch

    def serialised(*args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("a writer serialised a tensor file in memory (safetensors.torch.save)")

    monkeypatch.setattr(safetensors.torch, "save", serialised)
    obj = _module(kind)
    d = save(obj, tmp_path / "m", format=fmt, **kw)
    monkeypatch.undo()
    again = load(d, **({"weights_folded": True} if fmt == "llamascopium" else {}))
    want, got = _state(obj), _state(again)
    common = sorted(set(want) & set(got))
    assert common, (sorted(want), sorted(got))
    for k in common:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("fmt", ["nnsight_lorsa", "saelens", "sparsify"])
def test_load_checks_finiteness_in_slices(tmp_path: Path, monkeypatch: Any, fmt: str) -> None:
    kind = "topk" if fmt == "sparsify" else "relu"
    obj = _module(kind)
    kw = {"hook_name": "blocks.0.ln2.hook_normalized"} if fmt == "saelens" else {}
    d = save(obj, tmp_path / "m", format=fmt, **kw)
    monkeypatch.setattr(V, "FINITE_CHUNK", 64, raising=False)
    real, seen = torch.isfinite, []

    def isfinite(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.numel())
        return real(t)

    monkeypatch.setattr(torch, "isfinite", isfinite)
    load(d, dtype=torch.bfloat16)
    largest_row = max(t[0].numel() for t in obj.state_dict().values() if t.dim() > 0)
    assert seen and max(seen) <= max(64, largest_row), (max(seen), largest_row)


@pytest.mark.parametrize("seed", range(6))
def test_count_non_finite_matches_a_whole_tensor_count(seed: int, monkeypatch: Any) -> None:
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(V, "FINITE_CHUNK", int(torch.randint(1, 50, (), generator=g)))
    shape = [int(s) for s in torch.randint(1, 9, (int(torch.randint(0, 4, (), generator=g)),), generator=g)]
    dtype = [torch.float32, torch.bfloat16, torch.float16, torch.float64][seed % 4]
    t = torch.randn(shape, generator=g).to(dtype)
    flat = t.view(-1)
    bad = torch.rand(flat.shape, generator=g) < 0.2
    flat[bad] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)[
        torch.randint(0, 3, (int(bad.sum()),), generator=g)]
    want = int((~torch.isfinite(t)).sum())   # the reference: the whole tensor at once
    assert V.count_non_finite(t) == want
    if t.dim() >= 2:
        assert V.count_non_finite(t.transpose(0, 1)) == want   # a non-contiguous view (a transposed load)


# ------------------------------------------------------------------ slow: peak RSS per path

_PRE = '''
import gc, json, os, ctypes, torch
torch.manual_seed(0)
def _st(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def nbytes(m):
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())
from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa import formats
D = 64
def lorsa(n_ov=262144):                                 # 134 MB of W_V + W_O in fp32
    return Lorsa(LorsaConfig(d_model=D, n_qk_heads=64, d_qk_head=16, n_ov_heads=n_ov, top_k=64))
def tc(n=262144, act="topk", **kw):
    return Transcoder(TranscoderConfig(d_in=D, d_sae=n, activation=act,
                                       activation_params={"k": 64} if act == "topk" else {}, **kw))
tmp = os.environ["HOST_MEMORY_TMP"]                  # the parent's scratch folder, removed by it
LS = dict(hook_point_in="blocks.0.ln1.hook_normalized", hook_point_out="blocks.0.hook_attn_out")
CT = dict(feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
w = Lorsa(LorsaConfig(d_model=D, n_qk_heads=4, d_qk_head=16, n_ov_heads=64, top_k=4))  # one-time costs (imports,
formats.save(w, tmp + "/w"); formats.load(tmp + "/w"); formats.load(tmp + "/w", dtype=torch.bfloat16)  # meta kernels)
w.to(torch.bfloat16); w.normalize_decoder_()
'''
_LSAVED = "m = lorsa(); SIZE = nbytes(m); formats.save(m, tmp + '/l'); del m"
_LLS = "m = lorsa(); SIZE = nbytes(m); formats.save(m, tmp + '/l', format='llamascopium', **LS); del m"
_MHSA = '''
from nnsight_lorsa.adapters.base import MHSAWeights
H, E = 4, 16
mh = MHSAWeights(W_Q=torch.randn(H, D, E), b_Q=torch.zeros(H, E), W_K=torch.randn(H, D, E), b_K=torch.zeros(H, E),
                 W_V=torch.randn(H, D, E), b_V=torch.zeros(H, E), W_O=torch.randn(H, E, D), b_O=torch.zeros(D),
                 rotary=None, scale=0.25)
m = lorsa(); SIZE = nbytes(m)
'''


def _tc_saved(fmt: str, act: str, **kw: str) -> str:
    extra = "".join(f", {k}={v!r}" for k, v in kw.items())
    return f"m = tc(act={act!r}); SIZE = nbytes(m); formats.save(m, tmp + '/t', format={fmt!r}{extra}); del m"


# (name, setup, operation, bound on the peak above the baseline in module sizes). Loads: the file's pages
# (safetensors maps the file; the pages count as resident while mapped) + the module = ~2x.
RSS_CASES: list[tuple[str, str, str, float]] = [
    ("lorsa load (ours)", _LSAVED, "m = formats.load(tmp + '/l')", 2.45),
    ("lorsa load (ours) dtype=bf16", _LSAVED, "m = formats.load(tmp + '/l', dtype=torch.bfloat16)", 2.0),
    ("lorsa load (ours) device=meta", _LSAVED, "m = formats.load(tmp + '/l', device='meta')", 1.3),
    ("lorsa save (ours)", "m = lorsa(); SIZE = nbytes(m)", "formats.save(m, tmp + '/l')", 0.3),
    ("lorsa save (llamascopium)", "m = lorsa(); SIZE = nbytes(m)",
     "formats.save(m, tmp + '/l', format='llamascopium', **LS)", 0.3),
    ("lorsa load (llamascopium)", _LLS, "m = formats.load(tmp + '/l')", 2.45),
    ("lorsa convert llamascopium -> ours", _LLS, "formats.save(formats.load(tmp + '/l'), tmp + '/o')", 2.45),
    ("lorsa .to(bf16)", "m = lorsa(); SIZE = nbytes(m)", "m.to(torch.bfloat16)", 0.6),
    ("lorsa normalize_decoder_", "m = lorsa(); SIZE = nbytes(m)", "m.normalize_decoder_()", 0.2),
    ("lorsa init_from_mhsa", _MHSA, "m.init_from_mhsa(mh)", 1.2),
    ("lorsa recipe init (value_svd)", _MHSA + "from nnsight_lorsa.training.lorsa_recipe import init_lorsa\n"
     "x, y = torch.randn(2, 16, D), torch.randn(2, 16, D); mask = torch.ones(2, 16, dtype=torch.bool)",
     "init_lorsa(m, x, y, mask, s_in=1.0, s_out=1.0, mhsa=mh)", 1.8),
    ("transcoder save (ours)", "m = tc(); SIZE = nbytes(m)", "formats.save(m, tmp + '/t')", 0.3),
    ("transcoder load (ours)", _tc_saved("nnsight_lorsa", "topk"), "m = formats.load(tmp + '/t')", 2.45),
    ("transcoder save (saelens)", "m = tc(act='relu'); SIZE = nbytes(m)",
     "formats.save(m, tmp + '/t', format='saelens', hook_name='blocks.0.ln2.hook_normalized')", 0.3),
    ("transcoder load (saelens)", _tc_saved("saelens", "relu", hook_name="blocks.0.ln2.hook_normalized"),
     "m = formats.load(tmp + '/t')", 2.45),
    ("transcoder save (sparsify)", "m = tc(); SIZE = nbytes(m)", "formats.save(m, tmp + '/t', format='sparsify')", 0.7),
    ("transcoder load (sparsify)", _tc_saved("sparsify", "topk"), "m = formats.load(tmp + '/t', d_model=D)", 2.45),
    ("transcoders save (circuit_tracer, 2 layers)",
     "m = {0: tc(131072, 'relu', layer=0), 1: tc(131072, 'relu', layer=1)}; SIZE = sum(map(nbytes, m.values()))",
     "formats.save(m, tmp + '/c', format='circuit_tracer', **CT)", 0.5),
    ("transcoders load (circuit_tracer, 2 layers)",
     "m = {0: tc(131072, 'relu', layer=0), 1: tc(131072, 'relu', layer=1)}; SIZE = sum(map(nbytes, m.values()));"
     " formats.save(m, tmp + '/c', format='circuit_tracer', **CT); del m",
     "m = formats.load(tmp + '/c', format='circuit_tracer')", 2.45),
]


def peak_multiple(setup: str, operation: str) -> float:
    """Peak resident memory of ``operation`` above the resident memory after ``setup``, in module sizes
    (``SIZE`` set by ``setup``), in a fresh interpreter (``VmHWM`` reset by ``clear_refs`` 5)."""
    code = _PRE + textwrap.dedent(setup) + '''
gc.collect(); ctypes.CDLL(None).malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")
base = _st("VmRSS")
''' + textwrap.dedent(operation) + '''
print(json.dumps({"peak": _st("VmHWM") - base, "size": SIZE}))
'''
    from benchmarks.host_memory_paths import run_fresh

    out = run_fresh(code)
    return float(out["peak"]) / float(out["size"])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
@pytest.mark.parametrize("name,setup,operation,bound", RSS_CASES, ids=[c[0] for c in RSS_CASES])
def test_peak_host_memory_is_a_small_multiple_of_the_module(name: str, setup: str, operation: str,
                                                            bound: float) -> None:
    multiple = peak_multiple(setup, operation)
    assert multiple <= bound, f"{name}: peak {multiple:.2f}x the module's size (bound {bound}x)"
