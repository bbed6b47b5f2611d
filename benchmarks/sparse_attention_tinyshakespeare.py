"""Sparse-attention post-training (paper 003) on the tinyshakespeare models: CE and active edges.

Held-out split = the last 5% of the corpus characters, as in ``scripts/tinymodel.py``. Reports the
dense model's held-out CE (τ), the dense model under top-k attention (k = 1, 2, 4; paper Fig. 2a),
then post-trains with the GECO constraint ``CE <= τ_train`` (τ_train = the base model's CE on training
windows, the paper's choice) and reports held-out CE and the fraction of active edges (eval mode,
deterministic gates). The trained model is saved (HF directory + gates) and reloaded through nnsight.

    python -m benchmarks.sparse_attention_tinyshakespeare --steps 1500            # embedded Llama
    python -m benchmarks.sparse_attention_tinyshakespeare --train-gpt2 /tmp/ts-gpt2 # GPT-2 arch, same recipe
    python -m benchmarks.sparse_attention_tinyshakespeare --model /tmp/ts-gpt2 --steps 1500
"""

from __future__ import annotations

import json
import shlex
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks._timing import RESULTS, arg, parser, script, start, write_json
from benchmarks._tiny_models import split_ids, train_tiny


def circuit_sizes(dense_dir: str, sparse_dir: str, n_prompts: int = 16, seq_len: int = 20) -> dict:
    """Heads needed for 90% of the induction effect (paper 003 §4.2, Fig. 3), dense vs sparse model.

    Heads ranked by activation patching (clean value into the corrupt run), then only the top-k kept
    on the clean prompts: dense heads outside the circuit frozen to their mean over the corrupt
    prompts, sparse ones to zero (as in the paper). Edges: attention edges open on the clean prompts,
    in all heads and in the global circuit's heads (dense: every causal edge is open).
    """
    from transformers import AutoTokenizer

    from nnsight_lorsa.envoy import load_model
    from nnsight_lorsa.envoy.targets import MHSAHead, ReplacementModel
    from nnsight_lorsa.patching.circuit import circuit_size
    from nnsight_lorsa.patching.interventions import mean_activations
    from nnsight_lorsa.patching.tasks import induction_task
    from nnsight_lorsa.sparse_attention import edge_statistics, load_gates

    tok = AutoTokenizer.from_pretrained(dense_dir)
    task = induction_task(tok, n_prompts=n_prompts, seq_len=seq_len, seed=0)
    out = {}
    for name, path in (("dense", dense_dir), ("sparse", sparse_dir)):
        model = load_model(path)
        if name == "sparse":
            load_gates(model, path)
        res = ReplacementModel(model)
        heads = [MHSAHead(layer, h) for layer in range(res.adapter.n_layers) for h in range(res.adapter.n_heads)]
        means = mean_activations(res, heads, task.corrupt) if name == "dense" else None
        cs = circuit_size(res, task, heads, method="patching", mode="mean" if name == "dense" else "zero",
                          means=means)
        row = {"heads_total": len(heads), "global_k": cs.global_k,
               "per_prompt_k_median": float(cs.per_prompt_k.float().median()),
               "per_prompt_k_mean": float(cs.per_prompt_k.float().mean()),
               "effect_all_minus_none": float((cs.metric_all - cs.metric_none).mean()),
               "global_circuit": [[c.layer, c.head] for c in cs.global_circuit()]}
        if name == "sparse":
            with torch.no_grad():
                model._module(input_ids=task.clean)
            st = edge_statistics(model)
            circ = torch.zeros_like(st.active, dtype=torch.bool)
            for c in cs.global_circuit():
                circ[c.layer, c.head] = True
            row.update(active_edges_all_heads=float(st.active.sum()), possible_edges_all_heads=float(st.possible.sum()),
                       active_edges_in_circuit_heads=float(st.active[circ].sum()),
                       possible_edges_in_circuit_heads=float(st.possible[circ].sum()))
        else:
            n_pos = task.clean.shape[1]
            per_head = n_prompts * n_pos * (n_pos + 1) / 2
            row.update(active_edges_all_heads=per_head * len(heads),
                       active_edges_in_circuit_heads=per_head * cs.global_k)
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return {"task": f"induction_task(n_prompts={n_prompts}, seq_len={seq_len}, seed=0)", "threshold": 0.9, **out}


def main() -> None:
    args = parser(
        __doc__, model=arg(None, "HF model directory (default: the embedded Llama)"),
        train_gpt2=arg(None, "train the GPT-2-architecture model here (benchmarks/_tiny_models.py), exit",
                       type=Path), gpt2_steps=600,
        gpt2_warmup_steps=600, steps=1500, seq_len=64, batch_size=16, lr=1e-3, gate_lr=0.03, init_bias=5.0,
        geco_lr=1.0, max_lambda=100.0, lora_rank=arg(None, type=int),
        target_margin=arg(0.0, "constraint CE <= tau_train - margin"),
        repeat_fraction=arg(0.0, "share of training windows with a repeated segment (tinymodel's augmentation)"),
        recover_fraction=arg(0.0, "final share of steps: CE only, fixed gates"),
        decay_fraction=arg(0.0, "final share of steps with linear LR decay"), eval_every=250,
        out=arg(None, "save the sparse model here (default: a temp dir)", type=Path), tag=arg(None),
        circuit=arg(None, "only measure induction circuit sizes of a dense and a saved sparse model", nargs=2,
                    metavar=("DENSE_DIR", "SPARSE_DIR"))).parse_args()
    start(args, threads=1, seed=None)
    warnings.simplefilter("ignore")
    if args.circuit is not None:
        res = circuit_sizes(*args.circuit)
        res["command"] = shlex.join(["python", *sys.argv])
        path = write_json(RESULTS / f"sparse_attention_circuit_{args.tag or 'llama'}.json", res)
        print(f"wrote {path}")
        return
    if args.train_gpt2 is not None:
        print(json.dumps(train_tiny("gpt2", args.train_gpt2, args.gpt2_steps, args.gpt2_warmup_steps, 128, 16)))
        return

    import tempfile

    import nnsight
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnsight_lorsa.assets import default_model_dir
    from nnsight_lorsa.sparse_attention import install_gated_attention, load_gates, set_gate_mode
    from nnsight_lorsa.sparse_attention.io import save_sparse_model
    from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig, evaluate_sparse

    t0 = time.perf_counter()
    model_dir = str(args.model or default_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    train_ids, val_ids = split_ids(tok)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    arch = model.config.model_type
    ev = lambda m: evaluate_sparse(m, val_ids, seq_len=args.seq_len, batch_size=32)  # noqa: E731
    install_gated_attention(model, init_bias=args.init_bias)
    set_gate_mode(model, "dense")
    dense = ev(model)
    topk = {}
    for k in (1, 2, 4):
        set_gate_mode(model, "topk", top_k=k)
        r = ev(model)
        topk[k] = {"ce": r["ce"], "active_fraction": r["active_fraction"]}
        print(f"top-{k}: CE {r['ce']:.4f}  active {r['active_fraction']:.2%}", flush=True)
    set_gate_mode(model, "gated")
    at_init = ev(model)
    print(f"dense held-out CE (tau) {dense['ce']:.4f}; gated at init: CE {at_init['ce']:.4f} "
          f"active {at_init['active_fraction']:.2%}", flush=True)
    cfg = SparseTrainConfig(total_steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                            gate_lr=args.gate_lr, init_bias=args.init_bias, geco_lr=args.geco_lr,
                            max_lambda=args.max_lambda, lora_rank=args.lora_rank, target_margin=args.target_margin,
                            decay_frac=args.decay_fraction, recover_fraction=args.recover_fraction)
    augment = None
    if args.repeat_fraction > 0:
        repeat_augment = script("tinymodel")._repeat_augment
        augment = lambda x, g: repeat_augment(x, args.repeat_fraction, g)  # noqa: E731
    trainer = SparseAttentionTrainer(model, train_ids, cfg, augment=augment)
    curve = []
    t_train = time.perf_counter()
    while trainer.step < cfg.steps:
        trainer.train(min(args.eval_every, cfg.steps - trainer.step), progress=True)
        r = ev(trainer.hf)
        last = trainer.history[-1]
        curve.append({"step": trainer.step, "heldout_ce": r["ce"], "heldout_active_fraction": r["active_fraction"],
                      "lambda": last.lam, "train_ce_mean": sum(h.ce for h in trainer.history[-50:]) / 50})
        print(json.dumps(curve[-1]), flush=True)
    train_seconds = time.perf_counter() - t_train
    sparse_model = trainer.finished_model()
    final = ev(sparse_model)
    out = args.out or Path(tempfile.mkdtemp(prefix="sparse_attention_"))
    save_sparse_model(sparse_model, out, tokenizer=tok, training={"config": cfg.__dict__})
    lm = nnsight.LanguageModel(str(out), tokenizer=tok)
    load_gates(lm, out)
    reload = evaluate_sparse(lm, val_ids[: 16 * (args.seq_len - 1)], seq_len=args.seq_len)
    same = evaluate_sparse(sparse_model, val_ids[: 16 * (args.seq_len - 1)], seq_len=args.seq_len)
    payload = {
        "command": shlex.join(["python", *sys.argv]),
        "model": model_dir, "model_type": arch, "seq_len": args.seq_len,
        "heldout_tokens": dense["tokens"],
        "tau_heldout_ce": dense["ce"], "tau_train_ce": trainer.geco.target,
        "gated_at_init": {"ce": at_init["ce"], "active_fraction": at_init["active_fraction"]},
        "topk_dense_model": topk,
        "sparse": {"ce": final["ce"], "active_fraction": final["active_fraction"],
                   "expected_fraction": final["expected_fraction"],
                   "active_fraction_per_head": final["active_fraction_per_head"],
                   "ce_minus_tau": final["ce"] - dense["ce"]},
        "targets": {"ce_within_tau_plus_0.02": final["ce"] <= dense["ce"] + 0.02,
                    "active_fraction_le_5pct": final["active_fraction"] <= 0.05},
        "reloaded_through_nnsight_ce_equal": abs(reload["ce"] - same["ce"]) < 1e-5,
        "train_config": cfg.__dict__, "repeat_fraction": args.repeat_fraction, "curve": curve,
        "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - t0, "saved_to": str(out), "torch_threads": torch.get_num_threads(),
    }
    name = f"sparse_attention_tinyshakespeare_{args.tag or arch}.json"
    write_json(RESULTS / name, payload)
    print(json.dumps({k: payload[k] for k in ("tau_heldout_ce", "topk_dense_model", "targets")}, indent=1))
    print(f"sparse: CE {final['ce']:.4f} (tau {dense['ce']:.4f}), active {final['active_fraction']:.3%}; "
          f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
