"""Our side of the interventions check: nnsight-lorsa's ``nnsight_lorsa.patching`` on the same models and the peers'
files, case by case, compared with what the peers wrote. Imported by ``run.py`` (runs in our interpreter).

Each ``ct_*`` / ``sl_*`` function reads ``WORK/<peer>/<group>/`` and returns per-case rows (dicts of relative
differences, ``÷`` the peer's largest ``|value|`` unless said); ``run.py`` summarises them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _shared as S
import nnsight
import torch
from safetensors.torch import load_file

from nnsight_lorsa import CLTSet, ReplacementModel, SAESet, TranscoderSet
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.nodes import TRANSCODER
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.modules import TranscoderConfig
from nnsight_lorsa.modules.transcoder import Transcoder
from nnsight_lorsa.patching import (
    Feature,
    ablate,
    ablation_effect,
    activation_patching,
    freeze_attention,
    mean_activations,
    patch,
    path_patching,
    read,
    scale,
    steer,
)

L = S.N_LAYERS


def rel(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor | None = None) -> float:
    """``max |a − b| ÷ max |ref|`` (``ref`` defaults to ``b``), in the tensors' dtype (fp32, as the probe)."""
    ref = b if ref is None else ref
    return float((a - b).abs().max() / ref.abs().max().clamp_min(1e-30))


def demeaned(x: torch.Tensor) -> torch.Tensor:
    """Logits minus their mean over the vocabulary (TransformerLens's ``center_unembed``)."""
    return x - x.mean(-1, keepdim=True)


def plain_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's own logits (no replacement), ``ids`` (batch, pos)."""
    with torch.no_grad(), model.trace(ids):
        logits = nnsight.save(model.lm_head.output)
    return logits


def tc(layer: Any, f: int) -> Feature:
    return Feature(layer, f, kind="transcoder")


class Models:
    """The two models, loaded once (``load_model`` of ``WORK/models/<family>``)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self._models: dict[str, Any] = {}

    def __call__(self, family: str) -> Any:
        if family not in self._models:
            self._models[family] = load_model(str(S.model_dir(self.work, family)))
        return self._models[family]


# ------------------------------------------------------------------------------------------------- circuit-tracer
def ct_module(model: Any, path: Path) -> Any:
    """Our set of a circuit-tracer folder: ``CLTSet`` / ``TranscoderSet.from_pretrained``; a TopK set (circuit-tracer's
    files cannot say TopK) built from its raw tensors (``W_enc`` / ``W_dec`` ``(d_tc, d)`` there)."""
    if (path / "topk_raw.safetensors").exists():
        raw = load_file(str(path / "topk_raw.safetensors"))
        tcs = {}
        for layer in range(L):
            d_tc, d = raw[f"W_enc_{layer}"].shape
            t = Transcoder(TranscoderConfig(d_in=d, d_sae=d_tc, activation="topk", activation_params={"k": 6}))
            with torch.no_grad():
                t.W_enc.copy_(raw[f"W_enc_{layer}"].T)
                t.b_enc.copy_(raw[f"b_enc_{layer}"])
                t.W_dec.copy_(raw[f"W_dec_{layer}"])
                t.b_dec.copy_(raw[f"b_dec_{layer}"])
            tcs[layer] = t
        return TranscoderSet(model, tcs)
    config = (path / "config.yaml").read_text()
    return (CLTSet if "cross_layer_transcoder" in config else TranscoderSet).from_pretrained(model, path)


def run_features(model: Any, rm: ReplacementModel, ids: torch.Tensor, ivs: list[list]) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """Logits (pos, vocab) and every layer's features (layer, pos, feature) read before that layer's edits, with
    circuit-tracer's interventions ``[layer, pos | "all1", feature, value]`` made through the API: ``ablate`` for a
    value 0, else ``patch``; ``"all1"`` = positions 1 … n − 1 (a per-layer set's or a CLT's features alike)."""
    n = ids.shape[0]
    by_layer: dict[int, list] = {}
    for layer, p, f, v in ivs:
        by_layer.setdefault(layer, []).append((p, f, v))
    acts = {}
    with torch.no_grad(), model.trace(ids[None]):
        rm.prepare([tc(layer, 0) for layer in range(L)])
        for layer in range(L):
            values, _ = rm(tc(layer, 0)).location()
            acts[layer] = nnsight.save(values.clone())
            for p, f, v in by_layer.get(layer, []):
                target = rm(tc(layer, f))
                positions = slice(1, None) if p == "all1" else [p]
                if v == 0.0:
                    ablate(target, positions=positions)
                else:
                    patch(target, torch.full((1, n - 1 if p == "all1" else 1), float(v)), positions=positions)
        logits = nnsight.save(model.lm_head.output)
    return logits[0], torch.stack([acts[layer][0] for layer in range(L)])


def clean_patch(model: Any, rm: ReplacementModel, ids: torch.Tensor, spliced: list, targets: list) -> torch.Tensor:
    """Logits with each target patched to its own value at every position (``patch(t, read(t))``), in model order,
    the replacements of ``spliced`` in place (``prepare``)."""
    with torch.no_grad(), model.trace(ids):
        rm.prepare(spliced)
        for t in rm.sort(targets):
            bound = rm(t)
            patch(bound, read(bound))
        logits = nnsight.save(model.lm_head.output)
    return logits


def ct_free_cases(models: Models, work: Path, group: str) -> list[dict]:
    """``ct_gpt2`` / ``ct_llama``: each case's logits and features against circuit-tracer's free
    ``feature_intervention``; the unedited replacement (error term on) against the plain model; a clean-value patch of
    every edited feature against the unedited replacement."""
    src = S.side_dir(work, "circuit_tracer", group)
    model = models("gpt2" if group == "ct_gpt2" else "llama")
    mod_root = src.parent / "gpt2_modules" if group == "ct_gpt2" else src
    res = load_file(str(src / "results.safetensors"))
    sets: dict[str, Any] = {}
    rows = []
    for case in S.read_json(src / "cases.json"):
        key, name, ivs = case["key"], case["module"], case["ivs"]
        if name not in sets:
            sets[name] = ct_module(model, mod_root / name)
        rm = ReplacementModel(model, transcoders=sets[name])
        ids = res[f"{key}.ids"]
        plain = plain_logits(model, ids[None])[0]
        base, base_acts = run_features(model, rm, ids, [])
        logits, acts = run_features(model, rm, ids, ivs)
        edited = sorted({(layer, f) for layer, _, f, _ in ivs})
        noop = clean_patch(model, rm, ids[None], [tc(layer, 0) for layer in range(L)],
                           [tc(layer, f) for layer, f in edited])[0]
        theirs, their_acts = res[f"{key}.logits"], res[f"{key}.acts"]
        rows.append({
            "key": key, "module": name, "n_interventions": len(ivs),
            "logits": rel(logits, theirs),
            "acts": rel(acts[:, 1:], their_acts[:, 1:]),  # circuit-tracer's cache is zero at position 0
            "clean_acts": rel(base_acts[:, 1:], res[f"{key}.clean_acts"][:, 1:]),
            "ours_unedited_vs_plain": rel(base, plain), "ours_unedited_bitwise": bool(torch.equal(base, plain)),
            "noop": rel(noop, base), "noop_bitwise": bool(torch.equal(noop, base)),
            "peer_unedited_vs_plain": rel(res[f"{key}.base"], res[f"{key}.plain"]),
            "plain_vs_peer_hf": rel(plain, res[f"{key}.plain"]),
            "effect": rel(theirs, res[f"{key}.plain"]),
        })
    return rows


def ct_gpt2(models: Models, work: Path) -> list[dict]:
    return ct_free_cases(models, work, "ct_gpt2")


def ct_llama(models: Models, work: Path) -> list[dict]:
    return ct_free_cases(models, work, "ct_llama")


def ct_constrained(models: Models, work: Path) -> list[dict]:
    """circuit-tracer's ablation with every layer constrained (``constrained_layers=range(n_layers)``) against minus
    our attribution graph's feature → logit edges (the direct effect on each mean-subtracted logit), ÷ max |logit|;
    its ``freeze_attention=True``-only ablation against ours (``freeze_attention`` + ``prepare(..., frozen=...)``,
    the last position's logits ÷ its max |logit|) and against the same edges (how far it is from the direct
    effect: MLPs and norms move)."""
    src = S.side_dir(work, "circuit_tracer", "ct_constrained")
    model = models("gpt2")
    res = load_file(str(src / "results.safetensors"))
    ids = res["ids"]
    rows = []
    for name, picks in S.read_json(src / "cases.json").items():
        rm = ReplacementModel(model, transcoders=ct_module(model, src.parent / "gpt2_modules" / name))
        graph = attribute(rm, ids, batch_size=64, targets=list(range(S.VOCAB)))
        nodes, logit_ids = graph.nodes, graph.logit_ids
        tokens = nodes.index[logit_ids]
        base = res[f"{name}_base"]
        record = freeze_attention(rm, ids[None])
        for pick in picks:
            i, layer, pos, f = pick["i"], pick["layer"], pick["pos"], pick["feature"]
            node = ((nodes.kind == TRANSCODER) & (nodes.layer == layer) & (nodes.pos == pos)
                    & (nodes.index == f)).nonzero().flatten()
            if len(node) != 1:
                raise RuntimeError(f"{name}: feature ({layer}, {pos}, {f}) is not one node of our graph")
            edges = graph.edge_values(logit_ids, node.expand_as(logit_ids))
            moved = {}
            for tag, suffix in (("constrained", ""), ("freeze_attention", "_fa")):
                lo = res[f"{name}_{i}{suffix}"]
                moved[tag] = (demeaned(lo) - demeaned(base))[tokens]
            scale_ = float(base.abs().max())
            target = tc(layer, f)
            with torch.no_grad(), model.trace(ids[None]):
                rm.prepare([target], frozen=record)
                ablate(rm(target), positions=[pos])
                frozen = nnsight.save(model.lm_head.output)
            with torch.no_grad(), model.trace(ids[None]):
                rm.prepare([target])
                ablate(rm(target), positions=[pos])
                free = nnsight.save(model.lm_head.output)
            rows.append({
                "ours_free_vs_freeze_attention": rel(free[0, -1], res[f"{name}_{i}_fa"]),
                "key": f"{name}_{i}", "module": name,
                "freeze_attention_vs_ours": rel(frozen[0, -1], res[f"{name}_{i}_fa"]),
                "freeze_attention_effect": rel(res[f"{name}_{i}_fa"], base),
                "constrained_vs_edges": float((moved["constrained"] + edges).abs().max()) / scale_,
                "freeze_attention_vs_edges": float((moved["freeze_attention"] + edges).abs().max()) / scale_,
                "activation": abs(float(nodes.activation[node]) - pick["act"]) / abs(pick["act"]),
                "edge_max_over_logit_max": float(edges.abs().max()) / scale_,
            })
    return rows


def ct_bos(models: Models, work: Path) -> dict[str, Any]:
    """circuit-tracer's ablation at BOS against ours (the documented difference) and the aligned pair."""
    src = S.side_dir(work, "circuit_tracer", "ct_bos")
    model = models("gpt2")
    res, meta = load_file(str(src / "results.safetensors")), S.read_json(src / "cases.json")
    ids, layer, f = res["ids"][None], meta["layer"], meta["feature"]
    rm = ReplacementModel(model, transcoders=ct_module(model, src.parent / "gpt2_modules" / "relu"))

    def ablated(positions: Any) -> tuple[torch.Tensor, float]:
        with torch.no_grad(), model.trace(ids):
            rm.prepare([tc(layer, f)])
            at_bos = nnsight.save(read(rm(tc(layer, f)), positions=[0]))
            ablate(rm(tc(layer, f)), positions=positions)
            logits = nnsight.save(model.lm_head.output)
        return logits[0], float(at_bos.flatten()[0])

    plain = res["plain"]
    bos, ours_at_bos = ablated([0])
    every, _ = ablated(None)
    from_1, _ = ablated(slice(1, None))
    return {
        "layer": layer, "feature": f, "activation_at_bos": {
            "ours": ours_at_bos, "circuit_tracer_encoder": meta["true_activation_at_bos"],
            "circuit_tracer_cache": meta["circuit_tracer_cache_at_bos"]},
        "circuit_tracer_bos_ablation_vs_unedited": rel(res["bos"], plain),
        "ours_bos_ablation_vs_unedited": rel(bos, plain),
        "ours_vs_circuit_tracer_bos": rel(bos, res["bos"]),
        "ours_all_positions_vs_circuit_tracer_slice_none": rel(every, res["all"]),
        "aligned_ours_positions_1_on_vs_circuit_tracer_slice_none": rel(from_1, res["all"]),
    }


def ct_call_options(models: Models, work: Path) -> dict[str, Any]:
    """Our ``scale`` / ``steer`` against circuit-tracer's set to ``α·a`` / ``a + δ``; one pair of edits against its
    ``apply_activation_function=False`` / ``sparse=True`` / ``return_activations=False`` runs (logits), its
    pre-activation cache against our ``hook_sae_acts_pre`` and its sparse cache against ``hook_sae_acts_post``."""
    src = S.side_dir(work, "circuit_tracer", "ct_call_options")
    model = models("gpt2")
    res, meta = load_file(str(src / "results.safetensors")), S.read_json(src / "cases.json")
    ids = res["ids"][None]
    modules = src.parent / "gpt2_modules"
    ss = meta["scale_steer"]
    rm = ReplacementModel(model, transcoders=ct_module(model, modules / "relu"))
    out: dict[str, Any] = {}
    for kind, fn, value in (("scale", scale, ss["scale"]), ("steer", steer, ss["steer"])):
        target = tc(ss["layer"], ss["feature"])
        with torch.no_grad(), model.trace(ids):
            rm.prepare([target])
            fn(rm(target), value, positions=[ss["pos"]])
            logits = nnsight.save(model.lm_head.output)
        out[f"{kind}_vs_set"] = rel(logits[0], res[kind])
    rm = ReplacementModel(model, transcoders=ct_module(model, modules / "jumprelu"))
    pre, post = {}, {}
    with torch.no_grad(), model.trace(ids):
        env = rm.replace()["transcoders"]
        for layer in range(L):
            pre[layer] = nnsight.save(env[layer].hook_sae_acts_pre.output.clone())
            post[layer] = nnsight.save(env[layer].hook_sae_acts_post.output.clone())
            if layer == 0:
                patch(rm(tc(0, 7)), torch.tensor([[2.0]]), positions=[3])
            if layer == 1:
                ablate(rm(tc(1, 11)), positions=slice(1, None))
        logits = nnsight.save(model.lm_head.output)
    ours_pre = torch.stack([pre[layer][0] for layer in range(L)])
    ours_post = torch.stack([post[layer][0] for layer in range(L)])
    out.update({
        "apply_activation_function_false_logits": rel(logits[0], res["pre_logits"]),
        "sparse_logits": rel(logits[0], res["sparse_logits"]),
        "return_activations_false_logits": rel(logits[0], res["none_logits"]),
        "pre_activation_cache_vs_hook_sae_acts_pre": rel(ours_pre[:, 1:], res["pre"][:, 1:]),
        "sparse_cache_vs_hook_sae_acts_post": rel(ours_post[:, 1:], res["sparse"][:, 1:]),
    })
    return out


# --------------------------------------------------------------------------------------------------------- SAELens
def sl_replacement(model: Any, src: Path, saes_meta: list[dict], error: bool) -> tuple[ReplacementModel, list]:
    """The SAEs / transcoders of a case (SAELens folders read by ``SAESet`` / ``TranscoderSet.from_pretrained``, each
    at the site its file records) in one ``ReplacementModel``; ``targets[j]`` = ``(kind, site)`` of SAE ``j``."""
    saes, tcs, targets = {}, {}, []
    for m in saes_meta:
        if m["hook_out"]:
            s = TranscoderSet.from_pretrained(model, src / m["dir"])
            (layer,) = list(s)
            tcs[layer] = s[layer]
            targets.append(("transcoder", layer))
        else:
            s = SAESet.from_pretrained(model, src / m["dir"])
            (site,) = list(s)
            saes[site] = s[site]
            targets.append(("sae", site))
    return ReplacementModel(model, saes=saes or None, transcoders=tcs or None, error=error), targets


def sl_edit(bound: Any, iv: dict, n: int) -> None:
    """SAELens's hook edit ``iv`` on ``hook_sae_acts_post`` through our API."""
    p, v, kind = iv["pos"], iv["v"], iv["kind"]
    if kind == "set":
        patch(bound, torch.tensor([[v]]), positions=[p])
    elif kind == "zero":
        ablate(bound, positions=[p])
    elif kind == "scale":
        scale(bound, v, positions=[p])
    elif kind == "steer":
        steer(bound, v, positions=[p])
    elif kind == "set_all":
        patch(bound, torch.full((1, n), v))
    elif kind == "zero_all":
        ablate(bound)
    elif kind == "clean":
        patch(bound, read(bound, positions=[p]), positions=[p])


def sl_stacked_cases(models: Models, work: Path, group: str) -> list[dict]:
    """``sl_gpt2`` / ``sl_centred``: each case's logits (centred: mean-subtracted, as TransformerLens's
    ``center_unembed``) and every SAE's features before its edits against SAELens; the unedited replacement against
    SAELens's and (error term on) the plain model; a clean-value patch against the unedited replacement; centred:
    our features against SAELens's encoder fed its own live input minus its mean (``acts_vs_own_input_centred``)."""
    centred = group == "sl_centred"
    src = S.side_dir(work, "saelens", group)
    model = models("gpt2")
    res = load_file(str(src / "results.safetensors"))
    prep = demeaned if centred else (lambda x: x)
    rows = []
    for case in S.read_json(src / "cases.json"):
        key, err, ivs = case["key"], case["use_error_term"], case["ivs"]
        ids = res[f"{key}.ids"]
        n = len(ids)
        rm, targets = sl_replacement(model, src, case["saes"], err)

        def feat(j: int, f: int, targets: list = targets) -> Feature:
            return Feature(targets[j][1], f, kind=targets[j][0])

        firsts = [feat(j, 0) for j in range(len(targets))]
        order = rm.sort(firsts)
        acts = {}
        with torch.no_grad(), model.trace(ids[None]):
            rm.prepare(firsts)
            for t in order:
                j = firsts.index(t)
                values, _ = rm(t).location()
                acts[j] = nnsight.save(values.clone())
                for iv in ivs:
                    if iv["sae"] == j:
                        sl_edit(rm(feat(j, iv["f"])), iv, n)
            logits = nnsight.save(model.lm_head.output)
        with torch.no_grad(), model.trace(ids[None]):
            rm.prepare(firsts)
            base = nnsight.save(model.lm_head.output)
        edited = sorted({(iv["sae"], iv["f"]) for iv in ivs}) or [(j, 0) for j in range(len(targets))]
        noop = clean_patch(model, rm, ids[None], firsts, [feat(j, f) for j, f in edited])
        theirs = prep(res[f"{key}.logits"])
        row = {
            "key": key, "error": err, "saes": [[m["arch"], m["hook"], m["hook_out"]] for m in case["saes"]],
            "model_order": [firsts.index(t) for t in order],
            "logits": rel(prep(logits[0]), theirs),
            "acts_per_sae": [rel(acts[j][0], res[f"{key}.acts{j}"]) for j in range(len(targets))],
            "unedited_vs_saelens_unedited": rel(prep(base[0]), prep(res[f"{key}.base"]), theirs),
            "noop": rel(noop, base), "noop_bitwise": bool(torch.equal(noop, base)),
            "saelens_unedited_vs_plain": rel(prep(res[f"{key}.base"]), prep(res[f"{key}.plain_hf"]), theirs),
            "effect": rel(theirs, prep(res[f"{key}.base"]), theirs),
        }
        row["acts"] = max(row["acts_per_sae"])
        if err:
            plain = plain_logits(model, ids[None])
            row["ours_unedited_vs_plain"] = rel(base, plain)
            row["ours_unedited_bitwise"] = bool(torch.equal(base, plain))
        if centred:
            row["acts_vs_own_input_centred_per_sae"] = [rel(acts[j][0], res[f"{key}.hyp{j}"])
                                                        for j in range(len(targets))]
        rows.append(row)
    return rows


def sl_gpt2(models: Models, work: Path) -> list[dict]:
    return sl_stacked_cases(models, work, "sl_gpt2")


def sl_centred(models: Models, work: Path) -> list[dict]:
    return sl_stacked_cases(models, work, "sl_centred")


def sl_transcoders(models: Models, work: Path) -> list[dict]:
    """One transcoder spliced without the error term (``TranscoderSet.replace(layer, error=False)``): our logits
    against SAELens's ``HookedSAETransformer`` and against SAELens's ``forward`` spliced by hand; our module on
    SAELens's input against SAELens's ``forward`` there."""
    src = S.side_dir(work, "saelens", "sl_transcoders")
    model = models("gpt2")
    res = load_file(str(src / "results.safetensors"))
    rows = []
    for case in S.read_json(src / "cases.json"):
        key = case["key"]
        s = TranscoderSet.from_pretrained(model, src / case["dir"])
        (layer,) = list(s)
        with torch.no_grad(), model.trace(res[f"{key}.ids"][None]):
            s.replace(layer, error=False)
            logits = nnsight.save(model.lm_head.output)
        with torch.no_grad():
            direct = s[layer](res[f"{key}.x"])
        rows.append({
            "key": key, "arch": case["arch"], "input": case["in"], "layer": layer,
            "logits_vs_saelens_spliced": rel(logits[0], res[f"{key}.logits"]),
            "logits_vs_saelens_forward_by_hand": rel(logits[0], res[f"{key}.hand"]),
            "module_vs_saelens_forward": rel(direct, res[f"{key}.direct"]),
            "saelens_spliced_vs_forward_by_hand": rel(res[f"{key}.logits"], res[f"{key}.hand"]),
            "saelens_spliced_vs_decode_encode_by_hand": rel(res[f"{key}.logits"], res[f"{key}.no_skip"]),
        })
    return rows


def sl_batch(models: Models, work: Path) -> dict[str, Any]:
    """Per-row edits: two invokes (one per row) and one invoke with per-row values, against SAELens's hooks."""
    src = S.side_dir(work, "saelens", "sl_batch")
    model = models("gpt2")
    res, meta = load_file(str(src / "results.safetensors")), S.read_json(src / "cases.json")
    ids = res["ids"]
    sae_dirs = [src / d for d in meta["saes"] if d != meta["transcoder"]]
    saes = SAESet.from_pretrained(model, sae_dirs)
    tcs = TranscoderSet.from_pretrained(model, src / meta["transcoder"])
    (site0, site2), (layer1,) = list(saes), list(tcs)

    def f0(i: int) -> Feature:
        return Feature(site0, i, kind="sae")

    def f2(i: int) -> Feature:
        return Feature(site2, i, kind="sae")

    firsts = [f0(0), tc(layer1, 0), f2(0)]
    out: dict[str, Any] = {}
    for err in (True, False):
        rm = ReplacementModel(model, saes=saes, transcoders=tcs, error=err)
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(ids[:1]):
                rm.prepare(firsts)
                patch(rm(f0(3)), torch.tensor([[2.5]]), positions=[2])
                scale(rm(f2(7)), -1.0, positions=[-1])
                row0 = nnsight.save(model.lm_head.output)
            with tracer.invoke(ids[1:]):
                rm.prepare(firsts)
                values, _ = rm(f0(0)).location()
                values[:, 5, :] = 0  # every feature at one position: the site's tensor
                steer(rm(tc(layer1, 10)), 1.0)
                scale(rm(f2(7)), -1.0, positions=[-1])
                row1 = nnsight.save(model.lm_head.output)
        out[f"two_invokes_error_{err}"] = rel(torch.cat([row0, row1]), res[f"logits_{err}"])
        with torch.no_grad(), model.trace(ids):
            rm.prepare(firsts)
            bound = rm(f0(3))
            values, _ = bound.location()
            current = values[:, 2, 3].clone()
            patch(bound, torch.stack([torch.tensor(2.5), current[1]]).reshape(2, 1), positions=[2])
            values[1, 5, :] = 0
            steer(rm(tc(layer1, 10)), torch.tensor([[0.0], [1.0]]))
            scale(rm(f2(7)), -1.0, positions=[-1])
            both = nnsight.save(model.lm_head.output)
        out[f"one_invoke_per_row_values_error_{err}"] = rel(both, res[f"logits_{err}"])
    return out


def sl_experiments(models: Models, work: Path) -> dict[str, Any]:
    """``activation_patching`` / ``ablation_effect`` (zero, mean with ``mean_activations``) / ``path_patching``
    (frozen and ``freeze=False``) against the same experiments by hand with SAELens's hooks."""
    src = S.side_dir(work, "saelens", "sl_experiments")
    model = models("gpt2")
    res, meta = load_file(str(src / "results.safetensors")), S.read_json(src / "cases.json")
    saes = SAESet.from_pretrained(model, [src / "A", src / "B"])
    tcs = TranscoderSet.from_pretrained(model, src / "C")
    (site_a, site_b), (layer_c,) = list(saes), list(tcs)
    kw = {"correct_ids": res["correct"], "incorrect_ids": res["incorrect"]}
    out: dict[str, Any] = {}
    for err in (True, False):
        fe = meta[f"feats_{err}"]
        a, b = Feature(site_a, fe["A"], kind="sae"), Feature(site_b, fe["B"], kind="sae")
        c = tc(layer_c, fe["C"])
        rm = ReplacementModel(model, saes=saes, transcoders=tcs, error=err)
        ap = activation_patching(rm, res["clean"], res["corrupt"], [a, b, c, (a, b)], **kw)
        ab = ablation_effect(rm, res["clean"], [a, c], mode="zero", **kw)
        means = mean_activations(rm, [a, c], res["corrupt"])
        abm = ablation_effect(rm, res["clean"], [a, c], mode="mean", means=means, **kw)
        pp = path_patching(rm, res["clean"], [a, b, (a, b)], corrupt=res["corrupt"], **kw)
        ppf = path_patching(rm, res["clean"], [a, b, (a, b)], corrupt=res["corrupt"], freeze=False, **kw)
        out[f"error_{err}"] = {
            "activation_patching": {"clean": rel(ap.clean, res[f"ap_clean_{err}"]),
                                    "corrupt": rel(ap.corrupt, res[f"ap_corrupt_{err}"]),
                                    **{g: rel(ap.patched[i], res[f"ap_{g}_{err}"])
                                       for i, g in enumerate(["A", "B", "C", "AB"])}},
            "ablation_effect": {"baseline": rel(ab.baseline, res[f"ab_base_{err}"]),
                                "zero": rel(ab.ablated, res[f"ab_zero_{err}"]),
                                "mean": rel(abm.ablated, res[f"ab_mean_{err}"])},
            "path_patching": {"clean": rel(pp.clean, res[f"pp_clean_{err}"]),
                              **{g: rel(pp.patched[i], res[f"pp_{g}_{err}"]) for i, g in enumerate(["A", "B", "AB"])},
                              **{f"{g}_freeze_false": rel(ppf.patched[i], res[f"ppfree_{g}_{err}"])
                                 for i, g in enumerate(["A", "B", "AB"])}},
        }
        # not a difference between the sides: how far path patching's effect is from the total effect (SAELens's)
        out.setdefault("saelens_path_minus_total_effect_A", {})[f"error_{err}"] = float(
            (res[f"pp_A_{err}"] - res[f"ppfree_A_{err}"]).abs().max())
    return out


def sl_centred_pair(models: Models, work: Path) -> dict[str, Any]:
    """The centred-residual difference measured: SAE 2's features after SAE 1's ablation against SAELens's and against
    SAELens's encoder fed its own input minus its mean; the logits of the edit of SAE 1 alone and with SAE 2's most
    moved feature zeroed too (mean-subtracted, as ``center_unembed``)."""
    src = S.side_dir(work, "saelens", "sl_centred_pair")
    model = models("gpt2")
    res, meta = load_file(str(src / "results.safetensors")), S.read_json(src / "cases.json")
    saes = SAESet.from_pretrained(model, [src / d for d in meta["saes"]])
    site1, site2 = list(saes)
    rm = ReplacementModel(model, saes=saes)  # error term on

    def run(zero_g: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), model.trace(res["ids"]):
            rm.prepare([Feature(site1, 0, kind="sae"), Feature(site2, 0, kind="sae")])
            ablate(rm(Feature(site1, meta["f"], kind="sae")), positions=[3])
            values, _ = rm(Feature(site2, 0, kind="sae")).location()
            acts2 = nnsight.save(values.clone())
            if zero_g:
                ablate(rm(Feature(site2, meta["g"], kind="sae")))
            logits = nnsight.save(model.lm_head.output)
        return acts2, logits

    acts2, logits_a = run(False)
    _, logits_b = run(True)
    return {
        "later_features_vs_saelens": rel(acts2, res["acts2"]),
        "later_features_vs_saelens_encoder_on_own_input_minus_mean": rel(acts2, res["hyp2"]),
        "logits_edit_of_earlier_sae_only": rel(demeaned(logits_a), demeaned(res["logits_a"])),
        "logits_later_feature_edited_too": rel(demeaned(logits_b), demeaned(res["logits_b"])),
    }
