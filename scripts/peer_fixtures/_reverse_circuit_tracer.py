"""The reverse direction for circuit-tracer (run in OUR environment, by ``scripts/make_peer_fixtures.py``):
our modules saved with ``save(..., format="circuit_tracer")`` under ``OUT_DIR/reverse/<case>/``, with our
own outputs on fixed inputs (``ours_outputs.safetensors``: ``x`` and per layer ``encode_{i}`` /
``forward_{i}``, or a CLT's stacked ``encode`` / ``forward``). ``scripts/peer_fixtures/circuit_tracer.py``
then loads each case with circuit-tracer's ``load_transcoder_set`` / ``load_clt`` and records the
comparison in ``OUT_DIR/reverse/result.json``."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from nnsight_lorsa.formats import save
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig

D_MODEL, D_SAE = 8, 16
OURS_OUTPUTS = "ours_outputs.safetensors"


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            if name.endswith("threshold"):
                p.abs_().mul_(2)


def _x(*lead: int, seed: int) -> torch.Tensor:
    return torch.randn(*lead, 8, D_MODEL, generator=torch.Generator().manual_seed(seed))


def write_reverse(out: Path) -> None:
    """Write every reverse case under ``out`` (``OUT_DIR/reverse``)."""
    out.mkdir(parents=True, exist_ok=True)
    sets = {"transcoders_relu": ("relu", False), "transcoders_jumprelu": ("jumprelu", False),
            "transcoders_jumprelu_skip": ("jumprelu", True)}
    for seed, (case, (act, skip)) in enumerate(sets.items()):
        cls = SkipTranscoder if skip else Transcoder
        tcs = {}
        for layer in range(2):
            tcs[layer] = cls(TranscoderConfig(d_in=D_MODEL, d_sae=D_SAE, activation=act, layer=layer)).eval()
            _randomize(tcs[layer], 10 * seed + layer)
        save(tcs, out / case, format="circuit_tracer")
        x = _x(seed=seed)
        with torch.no_grad():
            outputs = {"x": x} | {f"encode_{i}": tc.encode(x) for i, tc in tcs.items()} \
                | {f"forward_{i}": tc(x) for i, tc in tcs.items()}
        save_file({k: v.contiguous() for k, v in outputs.items()}, str(out / case / OURS_OUTPUTS))
    for seed, act in enumerate(["relu", "jumprelu"]):
        clt = CrossLayerTranscoder(CLTConfig(d_in=D_MODEL, d_sae=D_SAE, n_layers=3, activation=act)).eval()
        _randomize(clt, 100 + seed)
        save(clt, out / f"clt_{act}", format="circuit_tracer")
        xs = _x(3, seed=50 + seed)
        with torch.no_grad():
            outputs = {"x": xs, "encode": clt.encode(xs), "forward": clt(xs)}
        save_file({k: v.contiguous() for k, v in outputs.items()}, str(out / f"clt_{act}" / OURS_OUTPUTS))
