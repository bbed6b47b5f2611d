"""``formats.load(..., device=, dtype=)`` of every format the package reads, straight onto a device (issue 21,
goal 1): our own files (a Lorsa, an SAE, a skip transcoder, a CLT, as ``save`` writes them) and the peers' own
files under ``tests/fixtures/peers`` (SAELens, sparsify, circuit-tracer per-layer transcoders and CLT,
Llamascopium Lorsas; what they load as against the peers' outputs is tests/formats/test_peer_fixtures_*.py).

Each case runs on the CPU and, as a ``gpu`` case, on CUDA (``helpers.DEVICES``), in fp32, bf16 and fp16:

* every tensor of the module (parameters and buffers) is on the device, every floating one in the dtype, and
  each equals bit for bit the same checkpoint loaded on the CPU with the same ``dtype=`` (the loaders read on
  the host and cast each tensor once: where it lands changes no value);
* the forward on the device against the fp32 CPU load's forward on the same input: in fp32 within
  ``REL`` (1e-5 of max |out|: kernel rounding); in bf16 / fp16 within ``LOW_FACTOR`` (4) times the error of
  the CPU load in that dtype, or the dtype's eps, whichever is larger (measured here, so the CPU case holds by
  construction and the CUDA case is held to the CPU's rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import DEVICES, make_clt, make_lorsa, make_sae, make_transcoder, tiny_hf_model
from peer_reference import PEER_FIXTURES, rel_error
from safetensors.torch import load_file

from nnsight_lorsa import get_adapter
from nnsight_lorsa.formats import load, save

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REL = 1e-5
LOW_FACTOR = 4.0

#: peer fixture folders (relative to tests/fixtures/peers), one or more of each kind each peer writes
PEER_CASES = ["saelens/standard", "saelens/topk", "saelens/jumprelu_transcoder", "saelens/skip_transcoder",
              "sparsify/sae", "sparsify/skip_transcoder", "sparsify/sae_bf16",
              "circuit_tracer/transcoders_jumprelu_skip", "circuit_tracer/clt_jumprelu",
              "llamascopium/relu_neox_qknorm", "llamascopium/bf16", "llamascopium/rotary_scale_2"]
OWN_CASES = ["own/lorsa", "own/sae", "own/skip_transcoder", "own/clt"]


@pytest.fixture(scope="module")
def own_dir(tmp_path_factory) -> Path:
    """Our own checkpoints, written by ``save``."""
    d = tmp_path_factory.mktemp("own")
    hf = tiny_hf_model("llama")
    save(make_lorsa(hf, get_adapter(hf)), d / "lorsa")
    save(make_sae(), d / "sae")
    save(make_transcoder(skip=True), d / "skip_transcoder")
    save(make_clt(), d / "clt")
    return d


def _path(case: str, own_dir: Path) -> Path:
    kind, name = case.split("/", 1)
    return own_dir / name if kind == "own" else PEER_FIXTURES / case


def _input(case: str, path: Path, module: Any) -> torch.Tensor:
    """The peer's own input (its reference file's ``x``, read in fp32), or a draw of ``(2, 6, d_in)`` (a CLT:
    one per layer)."""
    ref = path / "reference.safetensors"
    if ref.exists():
        return load_file(str(ref))["x"].float()
    if hasattr(module, "n_layers"):
        shape: tuple[int, ...] = (module.n_layers, 2, 6, module.cfg.d_in)
    else:
        shape = (2, 6, module.cfg.d_model if hasattr(module, "W_Q") else module.cfg.d_in)
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


def _modules(loaded: Any) -> Mapping[Any, torch.nn.Module]:
    """The modules of what ``load`` returned (a circuit-tracer per-layer set is a mapping of them)."""
    held = getattr(loaded, "transcoders", None)
    return held if isinstance(held, Mapping) else {None: loaded}


def _forward(loaded: Any) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Each module's forward on ``x`` (moved to the module's device and dtype), as fp32 CPU tensors."""
    def run(x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            for m in _modules(loaded).values():
                p = next(m.parameters())
                out = m(x.to(device=p.device, dtype=p.dtype))
                out = out[0] if isinstance(out, tuple) else out
                outs.append(out.float().cpu())
        return outs
    return run


def _state(loaded: Any) -> dict[str, torch.Tensor]:
    return {f"{key}.{name}": t for key, m in _modules(loaded).items() for name, t in m.state_dict().items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", OWN_CASES + PEER_CASES)
def test_load_straight_onto_the_device_equals_the_cpu_load(device, dtype, case, own_dir):
    path = _path(case, own_dir)
    got = load(path, device=device, dtype=dtype)
    host = load(path, dtype=dtype)
    state, host_state = _state(got), _state(host)
    assert state.keys() == host_state.keys() and state
    for name, t in state.items():
        assert t.device.type == torch.device(device).type, name
        assert not t.is_floating_point() or t.dtype == dtype, (name, t.dtype)
        assert torch.equal(t.cpu(), host_state[name]), name  # the same values wherever they land

    wide = load(path, dtype=torch.float32)
    x = _input(case, path, wide)
    want = _forward(wide)(x)
    outs = _forward(got)(x)
    errs = [rel_error(a, b) for a, b in zip(outs, want, strict=True)]
    if dtype == torch.float32:
        bound = REL
    else:
        cpu_err = max(rel_error(a, b) for a, b in zip(_forward(host)(x), want, strict=True))
        bound = max(LOW_FACTOR * cpu_err, torch.finfo(dtype).eps)
    assert max(errs) <= bound, (errs, bound)
    assert all(float(w.abs().max()) > 0 for w in want)  # not vacuous: the modules compute something
