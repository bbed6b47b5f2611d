"""Host syncs per forward of the replacement modules, the splices and the patching edits, counted on ``meta``.

On CUDA a ``non_blocking=False`` host-to-device copy and any device-to-host read (``.item()``, ``int(t)``,
``bool(t)``, ``nonzero``, ...) make the host wait for every kernel queued before it. Each path runs here on a
tiny model held on ``meta`` under a dispatch-mode spy that counts the operators reading a CPU tensor and writing a
``meta`` one (copies) and those reading a ``meta`` value back (reads; ``.item()`` is answered with 1 so that the
run goes on). A splice is counted as the trace with it minus the plain trace (the input ids' copy is nnsight's).
CPU and ``meta`` only. The tests assert the counts through ``tests/helpers.py``'s ``sync_spy``, which lists each
copy and read with its line; this spy counts them and answers ``.item()`` so that a run goes on past a read. A
script beside the tests it counts for (it builds the tests' tiny models), like ``tests/probe_counts.py``:

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/count_forward_syncs.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.masked_select",
         "aten._unique", "aten.unique", "aten.equal", "aten.bincount")


class Spy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_meta = any(t.device.type == "meta" for t in ins)
        if on_meta and str(func.overloadpacket).startswith(READS):
            self.reads += 1
            if str(func.overloadpacket) == "aten._local_scalar_dense":
                return 1
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" for t in ins) and any(t.device.type == "meta" for t in outs):
            self.copies += 1
        return out


def count(fn: Callable[[], Any]) -> tuple[int, int]:
    with torch.no_grad(), Spy() as spy:
        fn()
    return spy.copies, spy.reads


def rows() -> dict[str, tuple[int, int]]:
    from helpers import (  # this script runs from tests/ (module docstring)
        make_lorsa,
        meta_placement,
        random_ids,
        tiny_nnsight,
    )

    import nnsight_lorsa._placement as placement_module
    from nnsight_lorsa import ReplacementModel, TranscoderSet, get_adapter
    from nnsight_lorsa.envoy import Feature, MHSAHead
    from nnsight_lorsa.modules import (
        CLTConfig,
        CrossLayerTranscoder,
        SAEConfig,
        SparseAutoencoder,
        Transcoder,
        TranscoderConfig,
    )
    from nnsight_lorsa.patching import scale, steer

    placement_module.placement = meta_placement  # a meta module is refused otherwise
    params = {"relu": {}, "jumprelu": {"threshold": 0.05}, "topk": {"k": 4}, "batchtopk": {"k": 4},
              "abstopk": {"k": 4}, "groupmax": {"k": 4}}
    out: dict[str, tuple[int, int]] = {}
    x = torch.randn(2, 5, 16, device="meta")
    for act, p in params.items():
        for name, make in (("SAE", lambda **k: SparseAutoencoder(SAEConfig(d_in=16, d_sae=32, **k))),
                           ("Transcoder", lambda **k: Transcoder(TranscoderConfig(d_in=16, d_sae=32, **k)))):
            coder = make(activation=act, activation_params=p)
            if act == "batchtopk":
                coder.activation.set_threshold(0.1)
            coder.eval().to("meta")
            out[f"{name} forward, {act}"] = count(lambda c=coder: c(x))
    clt = CrossLayerTranscoder(CLTConfig(d_in=16, d_sae=32, n_layers=3, activation="batchtopk",
                                         activation_params={"k": 4}))
    for act in clt.activation:
        act.set_threshold(0.1)
    clt.eval().to("meta")
    out["CLT forward (3 layers), batchtopk"] = count(lambda: clt(torch.randn(3, 2, 5, 16, device="meta")))

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    t = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=64, activation="batchtopk",
                                    activation_params={"k": 4}))
    t.activation.set_threshold(0.1)
    r = ReplacementModel(model, transcoders=TranscoderSet(model, {0: t.eval()}), error=True)
    lorsa = make_lorsa(hf, adapter)
    hf.to("meta")
    t.to("meta")
    lorsa.to("meta")
    out["Lorsa forward"] = count(lambda: lorsa(torch.randn(2, 10, adapter.d_model, device="meta")))
    ids = random_ids().to("meta")

    def trace(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with model.trace(ids):
                body()
                model.output.save()
        return run

    plain = count(trace(lambda: None))
    delta = torch.ones(adapter.head_dim)
    for name, body in (("trace: TranscoderSet.replace (batchtopk, error=True)", lambda: r.replace()),
                       ("trace: steer(MHSAHead, host vector) + scale", lambda: (
                           steer(r(MHSAHead(0, 1)), delta), scale(r(MHSAHead(0, 0)), 2.0))),
                       ("trace: steer(Feature, number)", lambda: (r.replace(),
                                                                  steer(r(Feature(0, 7, kind="transcoder")), 1.5)))):
        c, n = count(trace(body))
        out[name] = (c - plain[0], n - plain[1])

    model16, hf16 = tiny_nnsight("llama", dtype=torch.float16)
    r16 = ReplacementModel(model16)
    hf16.to("meta")

    def trace16() -> None:
        with model16.trace(ids):
            steer(r16(MHSAHead(0, 1)), delta)
            model16.output.save()

    def plain16() -> None:
        with model16.trace(ids):
            model16.output.save()

    (c, n), (c0, n0) = count(trace16), count(plain16)
    out["trace, fp16 model: steer(MHSAHead, fp32 host vector)"] = (c - c0, n - n0)

    from nnsight_lorsa import LorsaSet
    for family, layer in (("llama", 1), ("gemma2", 0)):  # Gemma-2's layer 0 has a sliding window
        fmodel, fhf = tiny_nnsight(family)
        lorsas = LorsaSet(fmodel, {layer: make_lorsa(fhf, get_adapter(fmodel), layer)})
        fhf.to("meta")
        lorsas[layer].to("meta")

        def spliced(m=fmodel, s=lorsas, k=layer) -> None:  # type: ignore[no-untyped-def]
            with m.trace(ids):
                s.replace(layer=k, error=True)
                m.output.save()

        def bare(m=fmodel) -> None:  # type: ignore[no-untyped-def]
            with m.trace(ids):
                m.output.save()

        (c, n), (c0, n0) = count(spliced), count(bare)
        out[f"trace: LorsaSet.replace, {family} layer {layer}, error=True"] = (c - c0, n - n0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = rows()
    print("| path | host-to-device copies | device-to-host reads |\n|---|---|---|")
    for k, (c, n) in table.items():
        print(f"| {k} | {c} | {n} |")
    if args.out:
        args.out.write_text(json.dumps({k: {"copies": c, "reads": n} for k, (c, n) in table.items()}, indent=1))


if __name__ == "__main__":
    main()
