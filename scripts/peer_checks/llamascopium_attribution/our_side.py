"""nnsight-lorsa's side of the attribution check, run by ``run.py`` in our environment after ``their_side.py``::

    python our_side.py MODEL_DIR CASE_DIR

Loads the Lorsas / transcoders Llamascopium wrote in ``CASE_DIR`` with ``LorsaSet.from_pretrained`` /
``TranscoderSet.from_pretrained``, runs our ``attribute`` on their tokens with their logit targets, and, for every
head their ``qk_trace`` traced, our ``qk_attribution`` at the key position their head attends to most (the argmax
of their cached attention score row). Writes ``CASE_DIR/ours.safetensors`` (dense graph, node table, values),
``CASE_DIR/ours_qk.safetensors`` (one pair matrix and node table per distinct traced head) and ``CASE_DIR/ours.json``.

A file our loader refuses (``UnsupportedArchitectureError``) is not a crash here: ``ours.json`` then holds only
``{"refused": {"error": <class name>, "message": ...}}`` and the exit status is 0; ``run.py`` decides whether the
refusal was the expected one.
"""

from __future__ import annotations

import json
import re
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, attribute
from nnsight_lorsa.attribution import qk_attribution
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.errors import UnsupportedArchitectureError

KIND_NAMES = ("TRANSCODER", "LORSA", "MLP_ERROR", "ATTN_ERROR", "EMBEDDING", "BIAS", "LOGIT")


def replacement_model(model: Any, case: Path) -> ReplacementModel:
    """The replacement model with every ``lorsa_<L>`` / ``tc_<L>`` folder the case holds."""
    n_layers = model.config.num_hidden_layers
    kw = {}
    if (case / "lorsa_0").exists():
        kw["lorsas"] = LorsaSet.from_pretrained(model, {L: str(case / f"lorsa_{L}") for L in range(n_layers)})
    if (case / "tc_0").exists():
        kw["transcoders"] = TranscoderSet.from_pretrained(model, {L: str(case / f"tc_{L}") for L in range(n_layers)})
    return ReplacementModel(model, **kw)


def node_table(nodes: Any) -> dict[str, torch.Tensor]:
    return {"kind": nodes.kind, "layer": nodes.layer, "pos": nodes.pos, "index": nodes.index}


def qk_probes(rm: ReplacementModel, tokens: torch.Tensor, theirs: dict[str, torch.Tensor],
              their_meta: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Our ``qk_attribution`` for each head their ``qk_trace`` traced (one per distinct probe).

    Returns (probes, results, tensors): per traced head its ``layer``, OV ``head``, ``qpos``, ``kpos`` (argmax of
    their score row for the head's QK group), ``tie`` (that argmax not unique) and ``result`` (index into results);
    per distinct probe its score and bias names; tensors ``p<j>/pairs`` and ``p<j>/{kind,layer,pos,index}``."""
    probes, results, tensors = [], [], {}
    seen: dict[tuple[int, int, int, int], int] = {}
    for entry in their_meta["qk"]:
        layer = int(re.match(r"blocks\.(\d+)", entry["key"]).group(1))
        qpos, head = entry["idx"]
        hp = f"blocks.{layer}.hook_attn_out"
        score = theirs[f"cache/{hp}/score"]  # (n_qk_heads, query, key)
        heads_per_group = theirs[f"cache/{hp}/acts"].shape[-1] // score.shape[0]
        row = score[head // heads_per_group, qpos, : qpos + 1]
        kpos = int(row.argmax())
        probe = (layer, head, qpos, kpos)
        if probe not in seen:
            r = qk_attribution(rm, tokens, layer=layer, head=head, query_pos=qpos, key_pos=kpos)
            j = seen[probe] = len(results)
            results.append({"layer": layer, "head": head, "qpos": qpos, "kpos": kpos, "score": float(r.score),
                            "bias_names": list(r.nodes.bias_names)})
            tensors[f"p{j}/pairs"] = r.pairs.detach().float()
            tensors.update({f"p{j}/{k}": v for k, v in node_table(r.nodes).items()})
        probes.append({"layer": layer, "head": head, "qpos": qpos, "kpos": kpos,
                       "tie": bool((row == row.max()).sum() > 1), "result": seen[probe]})
    return probes, results, tensors


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model_dir, case = argv[0], Path(argv[1])
    theirs = load_file(str(case / "theirs.safetensors"))
    their_meta = json.loads((case / "theirs.json").read_text())
    tokens = torch.tensor(their_meta["opts"]["tokens"])
    model = load_model(model_dir)
    try:
        rm = replacement_model(model, case)
    except UnsupportedArchitectureError as e:
        print(f"refused: {type(e).__name__}: {e}")
        (case / "ours.json").write_text(json.dumps({"refused": {"error": type(e).__name__, "message": str(e)}}))
        return 0

    t0 = time.time()
    g = attribute(rm, tokens, targets=theirs["logit_ids"].tolist(), batch_size=64, qk_heads=64, zero_positions=0,
                  progress=False)
    attribute_s = time.time() - t0
    print("attribute s", attribute_s, g.summary())
    n = g.nodes
    out = {"A": g.densify().float(), "values": g.values.float(), "activation": n.activation.float(),
           "logit_probs": g.logit_probs.float(), **node_table(n)}
    save_file({k: v.contiguous() for k, v in out.items()}, str(case / "ours.safetensors"))

    probes, results, tensors = qk_probes(rm, tokens, theirs, their_meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(case / "ours_qk.safetensors"))
    meta = {"bias_names": n.bias_names, "kinds": {k: getattr(g, k) for k in KIND_NAMES},
            "edge_sum_error": float(g.edge_sum_error("mass").max()),
            "qk_pair_sum_error": max(map(float, g.qk.get("pair_sum_error", [])), default=None),
            "qk": {"probes": probes, "results": results}, "attribute_s": attribute_s,
            "versions": {p: version(p) for p in ("nnsight-lorsa", "torch", "transformers")}}
    (case / "ours.json").write_text(json.dumps(meta))
    print("done", tuple(out["A"].shape), "qk probes", len(probes), "distinct", len(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
