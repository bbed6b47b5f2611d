"""Classify the per-field probe cases written by the peers' own code (``scripts/peer_fixtures/probe_llamascopium.py``,
``scripts/peer_fixtures/probe_circuit_tracer.py``) as our ``formats.load`` (default arguments) treats them::

    PYTHONPATH=. python scripts/probe_peer_fields.py /tmp/probe_lsc /tmp/probe_ct [--json OUT.json]

Outcomes per case: ``correct`` (loads and matches the peer's reference output: relative max error <= 1e-4, or
<= 5e-2 for bf16 files, against the peer's fp32 reload of the file where the case has one), ``named`` (raises
an error of ours, ``nnsight_lorsa.errors.LorsaError``, naming the file),
``silent`` (loads and differs from the peer's output: a silent wrong result), ``raw`` (any other
exception), ``peer_refuses/named`` or ``peer_refuses/loads`` (the peer's own reload raises; ours refuses by name
or loads it). Prints one line per case and the counts.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nnsight_lorsa.errors import LorsaError
from nnsight_lorsa.formats import load


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@torch.no_grad()
def _compare(obj: Any, ref: dict[str, torch.Tensor]) -> float:
    x = ref["x"]
    if "forward" in ref:  # a CLT
        return _rel(obj(x.to(obj.W_enc.dtype)), ref["forward"])
    if "forward_0" in ref:  # a transcoder set
        errs = []
        for key, want in ref.items():
            if key.startswith("forward_"):
                tc = obj[int(key.split("_")[1])]
                errs.append(_rel(tc(x.to(tc.W_enc.dtype)), want))
        return max(errs)
    dtype = next(obj.parameters()).dtype
    return _rel(obj(x.to(dtype)), ref.get("out_fp32", ref["out"]))


def _with_keyword(folder: Path, meta: dict[str, Any]) -> str:
    """A Llamascopium ``"dataset-wise"`` folder refused as ambiguous: loaded again with the keyword of the writer
    that made it (``train`` -> ``weights_folded=True``, ``save_pretrained`` -> ``False``) and compared."""
    folded = meta.get("writer") == "train"
    obj = load(folder, weights_folded=folded)
    ref = load_file(str(folder / "reference.safetensors"))
    err = _compare(obj, ref)
    note = f"; with weights_folded={folded}: max rel {err:.2e} to the module they trained"
    if "out_folded" in ref:  # their own fold of a JumpReLU SAE leaves the threshold alone and changes the function
        note += f", {_compare(obj, {'x': ref['x'], 'out': ref['out_folded']}):.2e} to their folded module"
    return note


def classify(folder: Path, meta: dict[str, Any]) -> tuple[str, str]:
    peer_error = meta.get("peer_error")
    try:
        obj = load(folder)
    except LorsaError as e:
        if "does not say whether the weights" in str(e) and not peer_error:
            return "named", f"{type(e).__name__}: ambiguous dataset-wise folder" + _with_keyword(folder, meta)
        ok = folder.name in str(e) or "config" in str(e) or ".safetensors" in str(e)
        outcome = "named" if ok else "named (no file in message)"
        return ("peer_refuses/" + outcome if peer_error else outcome), f"{type(e).__name__}: {str(e)[:160]}"
    except Exception as e:  # noqa: BLE001 - the point is to count these
        return ("peer_refuses/raw" if peer_error else "raw"), f"{type(e).__name__}: {str(e)[:160]}"
    if peer_error:
        return "peer_refuses/loads", f"peer: {peer_error[:120]}"
    ref = load_file(str(folder / "reference.safetensors"))
    err = _compare(obj, ref)
    bound = 5e-2 if ref["x"].dtype == torch.bfloat16 or "bf16" in folder.name else 1e-4
    return ("correct" if err <= bound else "silent"), f"max rel {err:.2e} (bound {bound:g})"


def main(argv: list[str]) -> dict[str, Any]:
    out_json = None
    if "--json" in argv:
        i = argv.index("--json")
        out_json = Path(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    results: dict[str, Any] = {}
    for root in map(Path, argv):
        cases = json.loads((root / "cases.json").read_text())
        for name, meta in sorted(cases.items()):
            if not (root / name).is_dir():
                continue  # the peer could not even build it
            outcome, detail = classify(root / name, meta)
            results[name] = {"field": meta["field"], "value": meta["value"], "outcome": outcome, "detail": detail}
            print(f"{outcome:24s} {name:36s} {meta['field']}={meta['value']}: {detail}")
    counts = Counter(r["outcome"] for r in results.values())
    print(dict(sorted(counts.items())))
    doc = {"counts": dict(sorted(counts.items())), "cases": results}
    if out_json is not None:
        out_json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
