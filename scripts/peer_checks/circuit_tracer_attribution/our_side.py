"""nnsight-lorsa's side of the check, run by ``run.py`` in our environment after ``their_side.py``::

    python our_side.py CASE_DIR [--variant cached|lean|second|batch3|tracer] [--prune]

Reads the spec and token ids circuit-tracer's side wrote (``theirs.json``, ``theirs.safetensors``), loads the
Hugging Face model it saved with nnsight, the transcoders it wrote with our ``TranscoderSet`` / ``CLTSet``
``from_pretrained`` (TopK sets, which circuit-tracer cannot write as files, from its raw tensors into our
``Transcoder`` / ``SkipTranscoder``), and runs our ``attribute(..., zero_positions=1)`` with circuit-tracer's logit
settings (``max_n_logits`` / ``desired_logit_prob`` as ``LogitTargets``, or its explicit targets), batch size and
feature budget. ``--variant`` runs the same graph another way: ``cached`` (``cache_for_attribution`` first),
``lean`` (``memory="lean"``), ``second`` (after three calls on other prompts with the same objects), ``batch3``
(batch size 3), ``tracer`` (``attribute(tracer=...)`` inside a trace).

Writes ``CASE_DIR/ours[_<variant>].safetensors`` (node table, activations, values, logit ids and probabilities,
which rows were computed, the dense adjacency, the residual of unkept features, ``edge_sum_error("mass")``) and
``CASE_DIR/ours[_<variant>].json`` (node kinds, bias names, summary, versions). With ``--prune``: ``prune`` at
(0.8, 0.98) and (0.5, 0.9) and ``graph_scores`` to ``CASE_DIR/ours_prune.safetensors`` and the JSON's ``scores``.

A file our loader refuses (``UnsupportedArchitectureError``) is not a crash: the JSON then holds only
``{"refused": {"error": ..., "message": ...}}`` and the exit status is 0; ``run.py`` judges it.
"""

from __future__ import annotations

import json
import sys
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from nnsight import LanguageModel
from safetensors.torch import load_file, save_file

from nnsight_lorsa import CLTSet, ReplacementModel, TranscoderSet
from nnsight_lorsa.attribution import LogitTargets, attribute, cache_for_attribution, graph_scores, prune
from nnsight_lorsa.attribution import nodes as node_kinds
from nnsight_lorsa.errors import UnsupportedArchitectureError
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig

KIND_NAMES = ("TRANSCODER", "LORSA", "MLP_ERROR", "ATTN_ERROR", "EMBEDDING", "BIAS", "LOGIT")
VARIANTS = ("cached", "lean", "second", "batch3", "tracer")
PRUNE_THRESHOLDS = ((0.8, 0.98), (0.5, 0.9))


def topk_set(model: LanguageModel, tc_dir: Path, spec: dict[str, Any], n_layers: int) -> TranscoderSet:
    """Our TopK transcoders from circuit-tracer's raw tensors (``W_enc`` / ``W_dec`` ``(d_tc, d)`` there)."""
    raw = load_file(str(tc_dir / "topk_raw.safetensors"))
    cls = SkipTranscoder if spec.get("skip") else Transcoder
    tcs = {}
    for layer in range(n_layers):
        w_enc = raw[f"W_enc_{layer}"]
        tc = cls(TranscoderConfig(d_in=w_enc.shape[1], d_sae=w_enc.shape[0], activation="topk",
                                  activation_params={"k": spec.get("k", 6)}, layer=layer))
        with torch.no_grad():
            tc.W_enc.copy_(w_enc.T)
            tc.W_dec.copy_(raw[f"W_dec_{layer}"])
            tc.b_enc.copy_(raw[f"b_enc_{layer}"])
            tc.b_dec.copy_(raw[f"b_dec_{layer}"])
            if spec.get("skip"):
                tc.W_skip.copy_(raw[f"W_skip_{layer}"])  # x @ W_skip.T on both sides
        tcs[layer] = tc.eval()
    if spec["hooks"] != ["mlp.hook_in", "mlp.hook_out"]:
        raise SystemExit("TopK cases attach at the MLP call (mlp.hook_in / mlp.hook_out) only")
    return TranscoderSet(model, tcs)


def run_attribute(rm: ReplacementModel, model: LanguageModel, ids: torch.Tensor, kw: dict[str, Any],
                  variant: str) -> Any:
    """Our graph of ``ids``, computed the way ``variant`` names ("" for the plain call)."""
    if variant == "cached":
        return attribute(rm, cache_for_attribution(rm, ids), **kw)
    if variant == "lean":
        return attribute(rm, ids, memory="lean", **kw)
    if variant == "second":  # earlier calls on other prompts (same length, longer, shorter) with the same objects
        gen = torch.Generator().manual_seed(7)
        n_vocab = int(ids.max()) + 1
        for n in (len(ids), len(ids) + 3, len(ids) - 2):
            attribute(rm, torch.cat([ids[:1], torch.randint(2, n_vocab, (n - 1,), generator=gen)]), **kw)
        return attribute(rm, ids, **kw)
    if variant == "batch3":
        return attribute(rm, ids, **{**kw, "batch_size": 3})
    if variant == "tracer":
        with model.trace(ids[None]) as tracer:
            rm.replace()
            handle = attribute(rm, tracer=tracer, **kw)
        return handle.graph
    return attribute(rm, ids, **kw)


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    case = Path(sys.argv[1])
    args = sys.argv[2:]
    variant = args[args.index("--variant") + 1] if "--variant" in args else ""
    if variant and variant not in VARIANTS:
        raise SystemExit(f"--variant {variant!r}: one of {VARIANTS}")
    do_prune = "--prune" in args
    stem = f"ours_{variant}" if variant else "ours"
    meta = json.loads((case / "theirs.json").read_text())
    spec = meta["spec"]
    theirs = load_file(str(case / "theirs.safetensors"))
    ids = theirs["ids"]
    model = LanguageModel(str(case / "model"), dispatch=True, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = model._module(ids[None]).logits[0, -1]
    out_meta: dict[str, Any] = {
        # the model in our transformers against the same files in theirs (last position)
        "model_logits_vs_their_env_rel": float((hf_logits - theirs["hf_logits_last"]).abs().max()
                                               / theirs["hf_logits_last"].abs().max()),
        "versions": {p: version(p) for p in ("nnsight-lorsa", "nnsight", "torch", "transformers")},
    }
    tc_dir = case / "transcoders"
    try:
        if spec["kind"] == "clt":
            ts = CLTSet.from_pretrained(model, tc_dir)
        elif spec["act"] == "topk":
            ts = topk_set(model, tc_dir, spec, meta["n_layers"])
        else:
            ts = TranscoderSet.from_pretrained(model, tc_dir)
    except UnsupportedArchitectureError as e:
        out_meta["refused"] = {"error": type(e).__name__, "message": str(e)}
        (case / f"{stem}.json").write_text(json.dumps(out_meta, indent=1))
        print(json.dumps({"refused": out_meta["refused"]["error"]}))
        return
    rm = ReplacementModel(model, transcoders=ts)
    targets = (list(spec["targets"]) if spec.get("targets")
               else LogitTargets(max_n=spec.get("max_n_logits", 10), cumulative_prob=spec.get("desired_logit_prob",
                                                                                             0.95)))
    kw: dict[str, Any] = dict(batch_size=spec.get("batch", 64), zero_positions=1, targets=targets)
    if spec.get("max_feature_nodes"):
        kw["max_feature_nodes"] = spec["max_feature_nodes"]
    if spec.get("update_interval"):
        kw["update_interval"] = spec["update_interval"]
    g = run_attribute(rm, model, ids, kw, variant)
    n = g.nodes
    logit_ids = g.logit_ids.long() if g.logit_ids.dtype != torch.bool else g.logit_ids
    save_file({k: v.contiguous() for k, v in {
        "kind": n.kind, "layer": n.layer, "pos": n.pos, "index": n.index, "activation": n.activation.float(),
        "values": g.values.float(), "logit_probs": g.logit_probs.float(), "logit_ids": logit_ids,
        "feature_rows": g.feature_rows, "adjacency": g.densify().float(), "residual": g.residual.float(),
        "edge_sum_error": g.edge_sum_error("mass").float()}.items()}, str(case / f"{stem}.safetensors"))
    out_meta.update(kinds={k: getattr(node_kinds, k) for k in KIND_NAMES}, bias_names=list(n.bias_names),
                    n_nodes=g.n_nodes, summary=g.summary())
    if do_prune:
        masks = {}
        for nt, et in PRUNE_THRESHOLDS:
            pr = prune(g, nt, et)
            masks[f"node_mask_{nt}_{et}"] = pr.node_mask
            masks[f"edge_index_{nt}_{et}"] = pr.edge_index.contiguous()
        save_file(masks, str(case / "ours_prune.safetensors"))
        replacement, completeness = graph_scores(g)
        out_meta["scores"] = {"replacement": float(replacement), "completeness": float(completeness)}
    (case / f"{stem}.json").write_text(json.dumps(out_meta, indent=1))
    print(json.dumps({"n_nodes": g.n_nodes, "summary": g.summary()}))


if __name__ == "__main__":
    main()
