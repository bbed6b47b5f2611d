"""Attribution vs circuit-tracer: time, peak memory and edge agreement on the same graph.

    python -m benchmarks.attribution_vs_circuit_tracer [--lengths 32,64,128,256,512] [--batch 64] [--repeats 1]
        [--ct-python /work/scratch/peers/ct/bin/python] [--work DIR] [--systems pruned,dense,ct] [--parallel]
        [--max-feature-nodes N [--update-interval U]]

``--work DIR`` keeps the prompts and every child's result there (``run_{system}_{seq}_{repeat}.json``); a
result already there is reused, not rerun — for long lengths run in pieces (circuit-tracer at 512 tokens takes
tens of minutes on 2 cores). ``--parallel``: circuit-tracer's child runs beside ours (it waits, after its
measurement, for our pruned graph's nodes to read its submatrix there) — the memory numbers are unaffected,
the wall times are then contended (the CPU times less so).

Same model (the embedded tinyshakespeare Llama), same transcoders (the packaged TopK transcoders on all
four MLPs, no Lorsa: circuit-tracer has none), same prompts (the corpus at 20 000 characters, cut to each
length, BOS first), same logit targets (top-p 0.95, at most 10), every active feature a row, batch ``--batch``
for both, one thread. circuit-tracer 0.5.0 is not a dependency: it runs in its own venv (``--ct-python``;
torch 2.13, transformers 4.57, its TransformerLens backend on a ``HookedTransformerConfig`` built from the
model's config — llama3 RoPE as NTK-by-parts — with the weights converted by TransformerLens and the
transcoders handed over as its ``SingleLayerTranscoder`` with a TopK activation).

Every measurement is a fresh process (the variants interleaved per length and repeat): the peak RSS growth
(Linux ``VmHWM`` reset just before the call), the wall time and the process CPU time (one thread: the work
itself, not the waiting on a loaded machine) of one ``attribute`` call. Ours:
``attribute(rm, ids, batch_size=B)`` (the dense graph, ``"dense"``), ``prune=PruneConfig(0.8, 0.98)``
(the pruned graph from sparse rows, equal to dense pruning, ``"pruned"``). Theirs: ``attribute(ids, model,
batch_size=B)`` (their dense graph). The JSON (``benchmarks/results/attribution_vs_circuit_tracer.json``)
also records :func:`nnsight_lorsa.attribution.estimate_memory`'s prediction for each of our runs.

Ours runs with ``zero_positions=1`` (no feature nodes at position 0, the BOS token, as circuit-tracer), so
both graphs have the same feature nodes (the JSON records both counts). Edge agreement: the edges of our
pruned graph between nodes both graphs have (features, MLP errors off position 0 — circuit-tracer's error
there carries nothing, ours position 0's whole MLP output — embeddings, logits), against circuit-tracer's
adjacency at the same nodes: max |difference| / max |edge|.

``--max-feature-nodes N``: both compute only ``N`` feature rows, chosen by influence on the logits
(circuit-tracer's ``update_interval`` at its default 4; ours ``--update-interval``, default 4 too). Each child
then saves the (layer, position, feature) triples of its computed feature rows — circuit-tracer's
``active_features[selected_features]`` (``selected_features`` are its visited features), ours the transcoder
nodes with ``feature_rows`` set — and the JSON's ``feature_rows`` records, per length and per mode of ours,
``same_feature_rows`` (the dense graph's: the same set as circuit-tracer's; the pruned graph's feature nodes,
fewer — pruning drops visited features — are checked a subset), the sizes of both sets and of their
intersection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _peak_kb(field: str = "VmHWM") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    before = _peak_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    return before


# ----------------------------------------------------------------------------- circuit-tracer (its venv)
def ct_child(work: Path, seq: int, batch: int, max_feature_nodes: int | None) -> None:
    """In circuit-tracer's venv: build its replacement model from our files, attribute, report."""
    import torch
    from circuit_tracer import ReplacementModel, attribute
    from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
    from safetensors.torch import load_file
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    model_dir = ROOT / "nnsight_lorsa/assets/tinyshakespeare-llama"
    tc_dir = ROOT / "nnsight_lorsa/assets/tinyshakespeare-llama-transcoders"
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    rope = hf_cfg.get("rope_parameters") or hf_cfg.get("rope_scaling") or {}
    head = hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]
    cfg = HookedTransformerConfig(
        d_model=hf_cfg["hidden_size"], d_head=head, n_heads=hf_cfg["num_attention_heads"],
        d_mlp=hf_cfg["intermediate_size"], n_layers=hf_cfg["num_hidden_layers"],
        n_ctx=hf_cfg["max_position_embeddings"], eps=hf_cfg["rms_norm_eps"], d_vocab=hf_cfg["vocab_size"],
        act_fn=hf_cfg["hidden_act"], normalization_type="RMS", positional_embedding_type="rotary",
        rotary_adjacent_pairs=False, rotary_dim=head, final_rms=True, gated_mlp=True,
        n_key_value_heads=(hf_cfg["num_key_value_heads"]
                           if hf_cfg["num_key_value_heads"] != hf_cfg["num_attention_heads"] else None),
        rotary_base=rope.get("rope_theta", hf_cfg.get("rope_theta", 10000.0)),
        use_NTK_by_parts_rope=rope.get("rope_type") == "llama3",
        NTK_by_parts_low_freq_factor=rope.get("low_freq_factor", 1.0),
        NTK_by_parts_high_freq_factor=rope.get("high_freq_factor", 4.0),
        NTK_by_parts_factor=rope.get("factor", 8.0),
        NTK_original_ctx_len=rope.get("original_max_position_embeddings", 8192),
        original_architecture="LlamaForCausalLM", tokenizer_prepends_bos=True, dtype=torch.float32,
        default_prepend_bos=False)
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf_cfg.items() if k not in ("rope_parameters",)}))
    hf.load_state_dict(load_file(str(model_dir / "model.safetensors")), strict=False)
    state = convert_llama_weights(hf, cfg)

    class TopK(torch.nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.k = k

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # as nnsight_lorsa's TopK: top k, ReLU'd
            top = x.topk(self.k, dim=-1)
            return torch.zeros_like(x).scatter(-1, top.indices, top.values.relu())

    tcs = {}
    for layer in range(cfg.n_layers):
        meta = json.loads((tc_dir / f"layer_{layer}" / "config.json").read_text())["config"]
        w = load_file(str(tc_dir / f"layer_{layer}" / "model.safetensors"))
        tc = SingleLayerTranscoder(meta["d_in"], meta["d_sae"], TopK(meta["activation_params"]["k"]), layer,
                                   dtype=torch.float32, device=torch.device("cpu"))
        # circuit-tracer reads ``ln2.hook_normalized``, before TransformerLens applies the norm's weight;
        # ours read the MLP input after it: the weight folded into the encoder gives the same pre-activations
        tc.W_enc.data = (w["W_enc"].T * state[f"blocks.{layer}.ln2.w"][None, :]).contiguous()
        tc.W_dec.data = w["W_dec"].contiguous()
        tc.b_enc.data, tc.b_dec.data = w["b_enc"], w["b_dec"]
        tcs[layer] = tc
    transcoders = TranscoderSet(tcs, feature_input_hook="ln2.hook_normalized", feature_output_hook="hook_mlp_out")
    model = ReplacementModel.from_config(cfg, transcoders, backend="transformerlens")
    # circuit-tracer wraps each MLP and the unembedding (``mlp.old_mlp``, ``unembed.old_unembed``)
    state = {k.replace(".mlp.", ".mlp.old_mlp.").replace("unembed.", "unembed.old_unembed."): v
             for k, v in state.items()}
    missing = model.load_state_dict(state, strict=False)
    assert not [k for k in missing.missing_keys if not k.startswith("transcoders") and "IGNORE" not in k
                and "mask" not in k and "rotary" not in k], missing.missing_keys
    assert not missing.unexpected_keys, missing.unexpected_keys
    from transformers import PreTrainedTokenizerFast

    tok_dir = work / "tokenizer"  # transformers 4.57 does not know the v5 class name of the saved config
    tok_dir.mkdir(exist_ok=True)
    (tok_dir / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    model.set_tokenizer(PreTrainedTokenizerFast.from_pretrained(str(tok_dir)), default_padding_side="right")
    ids = torch.load(work / f"ids_{seq}.pt", weights_only=True)
    ref = torch.load(work / f"logits_{seq}.pt", weights_only=True)
    with torch.no_grad():
        logits = model(ids[None])[0, -1]
    logit_err = float((logits - ref).abs().max() / ref.abs().max())
    attribute(ids[:8], model, batch_size=batch)  # warm-up, as ours
    before = _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    g = attribute(ids, model, batch_size=batch, max_feature_nodes=max_feature_nodes)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = (_peak_kb() - before) / 1024
    out = {"system": "circuit-tracer", "seq": seq, "batch": batch, "seconds": seconds, "cpu_seconds": cpu,
           "peak_rss_growth_mb": peak, "n_nodes": int(g.adjacency_matrix.shape[0]),
           "n_features": int(len(g.active_features)),
           "model_logits_rel_err": logit_err}
    nodes_file = work / f"ours_nodes_{seq}.pt"
    for _ in range(int(os.environ.get("CT_WAIT_NODES_S", "0")) // 10):  # --parallel: our pruned child's nodes
        if nodes_file.exists() and (work / f"run_pruned_{seq}_0.json").exists():
            break
        time.sleep(10)
    if max_feature_nodes is not None:  # the visited features: the rows computed (selected_features = visited)
        torch.save(g.active_features[g.selected_features].clone(), work / f"ct_rows_{seq}.pt")
    if nodes_file.exists():  # the submatrix at our pruned graph's nodes (after the measurement)
        ours = torch.load(nodes_file, weights_only=True)  # (n, 4): kind, layer, pos, index (ours)
        n_pos, n_layers = len(ids), cfg.n_layers
        feats = g.active_features[g.selected_features]  # (n_f, 3): layer, pos, feature
        key = {(0, int(a), int(b), int(c)): i for i, (a, b, c) in enumerate(feats.tolist())}
        n_f = len(feats)
        err0, emb0 = n_f, n_f + n_layers * n_pos
        logit0 = emb0 + n_pos
        tokens = [int(t.vocab_idx) for t in g.logit_targets]
        index = []
        for kind, layer, pos, idx in ours.tolist():
            if kind == 0:
                index.append(key.get((0, layer, pos, idx), -1))
            elif kind == 2:
                index.append(err0 + layer * n_pos + pos)
            elif kind == 4:
                index.append(emb0 + pos)
            elif kind == 6:
                index.append(logit0 + tokens.index(idx) if idx in tokens else -1)
            else:
                index.append(-1)
        index_t = torch.tensor(index)
        safe = index_t.clamp_min(0)
        sub = g.adjacency_matrix[safe][:, safe].float()
        torch.save({"index": index_t, "adjacency": sub}, work / f"ct_sub_{seq}.pt")
    print(json.dumps(out))


# ----------------------------------------------------------------------------- ours
def _replacement():
    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.assets import default_transcoder_dir
    from nnsight_lorsa.envoy import load_model
    from nnsight_lorsa.formats import load

    model = load_model()
    tcs = {int(p.name.split("_")[1]): load(p) for p in sorted(default_transcoder_dir().glob("layer_*"))}
    return model, ReplacementModel(model, transcoders=tcs)


def ours_child(work: Path, seq: int, batch: int, mode: str, max_feature_nodes: int | None,
               update_interval: int = 4) -> None:
    import torch

    from nnsight_lorsa.attribution import PruneConfig, attribute, estimate_memory
    from nnsight_lorsa.attribution.nodes import TRANSCODER

    torch.set_num_threads(1)
    model, rm = _replacement()
    ids = torch.load(work / f"ids_{seq}.pt", weights_only=True)
    prune = PruneConfig(0.8, 0.98) if mode == "pruned" else None
    # zero_positions=1: no features at position 0 (the BOS token), as circuit-tracer's graphs
    predicted = estimate_memory(rm, ids, batch_size=batch, prune=prune, zero_positions=1,
                                max_feature_nodes=max_feature_nodes)
    attribute(rm, ids[:8], batch_size=batch, zero_positions=1)  # warm-up (imports, allocator)
    before = _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    g = attribute(rm, ids, batch_size=batch, prune=prune, zero_positions=1, max_feature_nodes=max_feature_nodes,
                  update_interval=update_interval)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = (_peak_kb() - before) / 1024
    out = {"system": f"ours ({mode})", "seq": seq, "batch": batch, "seconds": seconds, "cpu_seconds": cpu,
           "peak_rss_growth_mb": peak,
           "n_nodes": g.n_nodes, "n_features": predicted.terms["n_rows"] - len(g.logit_ids),
           "predicted_host_mb": predicted.host_bytes / 2**20,
           "predicted_over_measured": predicted.host_bytes / 2**20 / peak,
           "max_edge_sum_error": float(g.edge_sum_error("mass").max()), "update_interval": update_interval}
    if max_feature_nodes is not None:  # the computed feature rows: (layer, pos, feature) as circuit-tracer's
        n = g.nodes
        rows = (n.kind == TRANSCODER) & g.feature_rows
        torch.save(torch.stack([n.layer, n.pos, n.index], 1)[rows].clone(), work / f"ours_rows_{mode}_{seq}.pt")
    if mode == "pruned":
        out["stored_entries"] = g.meta["pruned"]["stored_entries"]
        n = g.nodes
        torch.save(torch.stack([n.kind, n.layer, n.pos, n.index], 1), work / f"ours_nodes_{seq}.pt")
        torch.save(g.densify(), work / f"ours_adj_{seq}.pt")
    print(json.dumps(out))


def agreement(work: Path, seq: int) -> dict:
    """Max |ours − theirs| / max |edge| over the edges of our pruned graph between shared nodes."""
    import torch

    sub = torch.load(work / f"ct_sub_{seq}.pt", weights_only=True)
    nodes = torch.load(work / f"ours_nodes_{seq}.pt", weights_only=True)
    ours = torch.load(work / f"ours_adj_{seq}.pt", weights_only=True)
    kind, pos = nodes[:, 0], nodes[:, 2]
    shared = (sub["index"] >= 0) & ~((kind == 2) & (pos == 0))  # circuit-tracer's error at 0 carries nothing
    s = shared.nonzero().flatten()
    a, b = ours[s][:, s].double(), sub["adjacency"][s][:, s].double()
    scale = float(a.abs().max())
    return {"seq": seq, "shared_nodes": int(len(s)), "of_nodes": int(len(nodes)), "edges_compared": int((a != 0).sum()),
            "max_abs_diff_over_max_edge": float((a - b).abs().max()) / scale,
            "ct_edges_there_nonzero": int((b != 0).sum())}


def feature_rows(work: Path, seq: int, mode: str) -> dict | None:
    """Our ``mode`` graph's computed feature rows against circuit-tracer's visited features (None: not both)."""
    import torch

    ct_f, ours_f = work / f"ct_rows_{seq}.pt", work / f"ours_rows_{mode}_{seq}.pt"
    if not (ct_f.exists() and ours_f.exists()):
        return None
    ct = {tuple(r) for r in torch.load(ct_f, weights_only=True).tolist()}
    ours = {tuple(r) for r in torch.load(ours_f, weights_only=True).tolist()}
    out = {"seq": seq, "mode": mode, "n_ct": len(ct), "n_ours": len(ours), "n_intersection": len(ct & ours),
           "only_ct": sorted(ct - ours)[:20], "only_ours": sorted(ours - ct)[:20]}
    if mode == "dense":  # every visited feature is a node of the dense graph
        return {**out, "same_feature_rows": ct == ours}
    return {**out, "subset_of_ct": ours <= ct}  # pruning drops visited features: its rows are a subset


def main() -> None:
    from benchmarks._timing import arg, command, parser, write

    args = parser(__doc__, lengths="32,64,128,256,512", batch=64, repeats=1,
                  ct_python=arg("/work/scratch/peers/ct/bin/python", "circuit-tracer's venv python"),
                  child=arg(None, argparse_suppress()), seq=arg(0, argparse_suppress()),
                  work=arg("", "keep prompts and child results here; results there are reused"),
                  systems=arg("pruned,dense,ct", "children to run (pruned before ct: ct reads its nodes)"),
                  parallel=arg(False, "run circuit-tracer's child beside ours"),
                  max_feature_nodes=arg(0, "feature rows of both (circuit-tracer's influence order); 0: all"),
                  update_interval=arg(4, "ours only (circuit-tracer keeps its default 4): batches per ranking"),
                  name=arg("attribution_vs_circuit_tracer", "result JSON name")).parse_args()
    mfn = args.max_feature_nodes or None
    if args.child:
        work = Path(args.work)
        if args.child == "ct":
            ct_child(work, args.seq, args.batch, mfn)
        else:
            ours_child(work, args.seq, args.batch, args.child, mfn, args.update_interval)
        return
    import torch

    lengths = [int(s) for s in args.lengths.split(",") if s]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="attr_vs_ct_"))
    work.mkdir(parents=True, exist_ok=True)
    model, rm = _replacement()
    text = (ROOT / "nnsight_lorsa/assets/tinyshakespeare.txt").read_text(encoding="utf-8")[20_000:40_000]
    all_ids = model.tokenizer(text, return_tensors="pt")["input_ids"][0]
    for seq in lengths:
        ids = all_ids[:seq].clone()
        torch.save(ids, work / f"ids_{seq}.pt")
        with torch.no_grad():
            torch.save(model._module(ids[None]).logits[0, -1].clone(), work / f"logits_{seq}.pt")
    del model, rm
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    runs: list[dict] = []
    agree: list[dict] = []
    row_sets: list[dict] = []
    systems = args.systems.split(",")

    def launch(child: str, seq: int) -> subprocess.Popen:
        python = args.ct_python if child == "ct" else sys.executable
        ct_env = {**os.environ, "PYTHONPATH": "", "CT_WAIT_NODES_S": str(6 * 3600 if args.parallel else 0)}
        return subprocess.Popen([python, "-m", f"benchmarks.{Path(__file__).stem}", "--child", child, "--seq",
                                 str(seq), "--batch", str(args.batch), "--work", str(work), "--max-feature-nodes",
                                 str(args.max_feature_nodes), "--update-interval", str(args.update_interval)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env if child != "ct" else ct_env, cwd=ROOT)

    def finish(proc: subprocess.Popen, child: str, seq: int, rep: int) -> None:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{child} @ {seq} failed:\n{err[-3000:]}")
        r = {**json.loads(out.strip().splitlines()[-1]), "repeat": rep}
        (work / f"run_{child}_{seq}_{rep}.json").write_text(json.dumps(r))

    for seq in lengths:
        for rep in range(args.repeats):
            todo = [c for c in ("pruned", "dense", "ct")  # pruned first: circuit-tracer's run reads its nodes
                    if c in systems and not (work / f"run_{c}_{seq}_{rep}.json").exists()]
            ct = launch("ct", seq) if args.parallel and "ct" in todo else None
            for child in todo:
                if child != "ct" or ct is None:
                    finish(launch(child, seq), child, seq, rep)
            if ct is not None:
                finish(ct, "ct", seq, rep)
            for child in ("pruned", "dense", "ct"):
                f = work / f"run_{child}_{seq}_{rep}.json"
                if f.exists():
                    runs.append(json.loads(f.read_text()))
                    print(json.dumps(runs[-1]), flush=True)
        if (work / f"ct_sub_{seq}.pt").exists():
            agree.append(agreement(work, seq))
            print(json.dumps(agree[-1]), flush=True)
        for mode in ("dense", "pruned"):
            if (rs := feature_rows(work, seq, mode)) is not None:
                row_sets.append(rs)
                print(json.dumps(rs), flush=True)
    rows = []
    for seq in lengths:
        def med(system: str, key: str, seq: int = seq) -> float:
            vals = sorted(r[key] for r in runs if r["seq"] == seq and r["system"] == system and key in r)
            return vals[len(vals) // 2] if vals else float("nan")
        ct_mb, ct_s = med("circuit-tracer", "peak_rss_growth_mb"), med("circuit-tracer", "seconds")
        ct_cpu = med("circuit-tracer", "cpu_seconds")
        row = {"seq": seq, "ct_mb": ct_mb, "ct_s": ct_s, "ct_cpu_s": ct_cpu}
        for mode in ("dense", "pruned"):
            row[f"{mode}_mb"] = med(f"ours ({mode})", "peak_rss_growth_mb")
            row[f"{mode}_s"] = med(f"ours ({mode})", "seconds")
            row[f"{mode}_cpu_s"] = med(f"ours ({mode})", "cpu_seconds")
            row[f"{mode}_mem_ratio"] = row[f"{mode}_mb"] / ct_mb
            row[f"{mode}_time_ratio"] = row[f"{mode}_s"] / ct_s
            row[f"{mode}_cpu_ratio"] = row[f"{mode}_cpu_s"] / ct_cpu  # one thread: the work, not the waiting
            row[f"{mode}_predicted_ratio"] = med(f"ours ({mode})", "predicted_over_measured")
        rows.append(row)
        print(json.dumps(row))
    out = {"command": command(), "batch": args.batch, "threads": 1, "max_feature_nodes": mfn,
           "update_interval": {"ours": args.update_interval, "circuit-tracer": 4}, "runs": runs,
           "agreement": agree, "table": rows}
    if mfn is not None:
        out["feature_rows"] = row_sets
        dense_sets = [r for r in row_sets if r["mode"] == "dense"]
        out["same_feature_rows"] = bool(dense_sets) and all(r["same_feature_rows"] for r in dense_sets)
    print(f"-> {write(args.name, out)}")


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
