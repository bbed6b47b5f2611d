"""Head-to-head: the Lorsa authors' own trainer (OpenMOSS llamascopium 2.0.0b34) on our cached batches.

Three steps, two environments (llamascopium is never a dependency of ours; the ``train`` step
imports only llamascopium, torch and safetensors, the ``measure`` step only our package)::

    # 1. ours: the layer's training windows, batch order, held-out windows and MHSA (lorsa_recipe.export)
    OMP_NUM_THREADS=1 python -m benchmarks.lorsa_recipe --steps 600 --export DIR
    # 2. their venv: build, initialise, train and save each variant with llamascopium's own code
    OMP_NUM_THREADS=1 /work/scratch/peers/llamascopium/bin/python -m benchmarks.lorsa_llamascopium train DIR \\
        --variants doc_lr4e-3,doc_lr2e-4,doc_auxk_kanneal_lr4e-3,random_lr4e-3,doc_lr2e-4_warmup5000
    # (issue 26: their lr sweep doc_lr1e-3, doc_lr2e-3; other budgets with --steps 300/400 into a DIR
    #  per budget, e.g. links to the same export files: train.json keeps one row per variant name)
    # 3. ours: load each saved Lorsa with our loader, held-out FVU / L0 / dead (lorsa_recipe.heldout_metrics)
    OMP_NUM_THREADS=1 python -m benchmarks.lorsa_llamascopium measure DIR \\
        --out benchmarks/results/lorsa_llamascopium.json

What ``train`` runs, per variant (llamascopium ``src/llamascopium/``):

* ``LorsaConfig`` with our dims: ``n_ov_heads = d_sae`` (``expansion_factor = n_ov/d_model``),
  ``n_qk_heads``, ``d_qk_head``, ``top_k``, ``act_fn="topk"``, ``n_ctx = seq_len``, the embedded layer's
  rotary (half-split pairs, ``rotary_base``, llama3 RoPE as ``use_NTK_by_parts_rope``), ``attn_scale =
  √head_dim``, ``norm_activation="dataset-wise"``, ``sparsity_include_decoder_norm`` (their default);
  hook names ``blocks.L.ln1.hook_normalized`` / ``blocks.L.hook_attn_out``.
* Their documented initialisation (``docs/models/lorsa.md``: ``InitializerConfig(grid_search_init_norm=True,
  initialize_lorsa_with_mhsa=True, initialize_W_D_with_active_subspace=True, model_layer=L)``), run as
  ``initializer.py::Initializer.initialize_sae_from_config`` runs it, step by step (that function needs a
  TransformerLens language model; we give their methods a TransformerLens ``GroupedQueryAttention``
  holding the layer's weights instead): ``Initializer.initialize_parameters`` (``init_encoder_with_decoder_transpose``
  is off: ``LowRankSparseAttention`` is not ``EncoderInitializable`` and the default ``True`` fails
  their assertion), ``calculate_activation_norm`` on the first 8 batches, ``init_lorsa_with_mhsa``,
  ``init_W_V_with_active_subspace_per_head`` on batch 0, ``Initializer.initialization_search`` (the grid
  search over the decoder norm) on batch 0. The ``random_*`` variants skip the two MHSA steps.
* Their ``trainer.py::Trainer.fit`` on batches ``0 … steps−1`` in our order (``{hook_in: x, hook_out: y,
  "tokens", "mask": loss_mask}``; ``total_training_tokens = steps · 16 · seq_len``): their loss
  (masked mean of the per-token squared error in normalised space), Adam, their ``constantwithwarmup``
  schedule (warm-up ``--warmup``, default 5% of the steps like ours — their default 5000 steps would
  never reach the peak lr in 600; variant ``doc_lr2e-4_warmup5000`` keeps it — then a 20% cool-down to
  1/32), k annealing from ``initial_k``
  over ``k_warmup_steps``, AuxK with ``auxk_coefficient``/``dead_threshold``/``k_aux``;
  ``amp_dtype=float32`` (their pythia Lorsa example; CPU).
* Saved as ``runners/train.py::train_lorsa`` saves: ``cfg.save_hyperparameters`` before ``fit``, then
  ``save_pretrained(fold_activation_scale=True)`` — a folder whose ``config.json`` still says
  ``"dataset-wise"`` next to folded weights, so ``measure`` loads it with ``weights_folded=True``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent

# name -> TrainerConfig overrides and init; "doc" = the documented initialisation
VARIANTS: dict[str, dict[str, Any]] = {
    "doc_lr4e-3": {"init": "documented", "lr": 4e-3},
    "doc_lr2e-4": {"init": "documented", "lr": 2e-4},
    "doc_auxk_kanneal_lr4e-3": {"init": "documented", "lr": 4e-3, "auxk_coefficient": 1 / 32,
                                "dead_threshold": 20_000, "initial_k": 64, "k_warmup_steps": 0.1},
    "random_lr4e-3": {"init": "random", "lr": 4e-3},
    "doc_lr2e-4_warmup5000": {"init": "documented", "lr": 2e-4, "lr_warm_up_steps": 5000},  # their default warm-up
    "doc_lr1e-3": {"init": "documented", "lr": 1e-3},
    "doc_lr2e-3": {"init": "documented", "lr": 2e-3},
}


class Batches:
    """Re-iterable stream of the exported batches as llamascopium's trainer reads them."""

    def __init__(self, train: dict[str, torch.Tensor], hook_in: str, hook_out: str, n: int) -> None:
        self.t, self.hook_in, self.hook_out, self.n = train, hook_in, hook_out, n

    def batch(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.t["batch_windows"][i]
        x = self.t["x"][ids]
        return {self.hook_in: x, self.hook_out: self.t["y"][ids],
                "tokens": torch.zeros(x.shape[:2], dtype=torch.long), "mask": self.t["loss_mask"][ids]}

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self.batch(i) for i in range(self.n))


def their_attention(meta: dict[str, Any], mhsa: dict[str, torch.Tensor]) -> Any:
    """A TransformerLens ``GroupedQueryAttention`` holding the layer's weights (what their
    ``init_lorsa_with_mhsa`` / ``init_W_V_with_active_subspace_per_head`` read: ``W_Q W_K W_V W_O``,
    ``cfg.n_heads d_model d_head``; ``W_K``/``W_V`` repeat the KV heads like ours)."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.components import Attention, GroupedQueryAttention

    gqa = meta["n_kv_heads"] != meta["n_heads"]
    cfg = HookedTransformerConfig(n_layers=1, d_model=meta["d_model"], n_ctx=meta["seq_len"], d_head=meta["head_dim"],
                                  n_heads=meta["n_heads"], n_key_value_heads=meta["n_kv_heads"] if gqa else None,
                                  act_fn="silu", d_vocab=2, positional_embedding_type="rotary",
                                  rotary_dim=meta["head_dim"], dtype=torch.float32)
    attn = GroupedQueryAttention(cfg) if gqa else Attention(cfg)
    with torch.no_grad():
        attn.W_Q.copy_(mhsa["W_Q"])
        attn.W_O.copy_(mhsa["W_O"])
        (attn._W_K if gqa else attn.W_K).copy_(mhsa["W_K"])
        (attn._W_V if gqa else attn.W_V).copy_(mhsa["W_V"])
    assert torch.equal(attn.W_K[1], mhsa["W_K"][1 // (meta["n_heads"] // meta["n_kv_heads"])])
    return attn


def train_variant(name: str, spec: dict[str, Any], meta: dict[str, Any], train: dict[str, torch.Tensor],
                  mhsa: dict[str, torch.Tensor], check_x: torch.Tensor, out: Path, steps: int, warmup: float,
                  seed: int) -> dict[str, Any]:
    from llamascopium.initializer import Initializer, InitializerConfig
    from llamascopium.models.lorsa import LorsaConfig, LowRankSparseAttention
    from llamascopium.trainer import Trainer, TrainerConfig
    from llamascopium.utils.misc import calculate_activation_norm

    layer = meta["layer"]
    hook_in, hook_out = f"blocks.{layer}.ln1.hook_normalized", f"blocks.{layer}.hook_attn_out"
    rot = meta["rotary"]
    rope: dict[str, Any] = {}
    if rot is None:  # GPT-2: learned positions, no rotary in the attention
        rope = {"positional_embedding_type": "none"}
        rot = {"rotary_dim": meta["head_dim"], "base": 10000, "interleaved": False}
    elif rot["rope_type"] == "llama3":
        s = rot["scaling"]
        rope = {"use_NTK_by_parts_rope": True, "NTK_by_parts_factor": s["factor"],
                "NTK_by_parts_low_freq_factor": s["low_freq_factor"],
                "NTK_by_parts_high_freq_factor": s["high_freq_factor"],
                "old_context_len": int(s["original_max_position_embeddings"])}
    elif rot["rope_type"] != "default":
        raise SystemExit(f"rope_type {rot['rope_type']!r} has no llamascopium equivalent")
    assert float(rot["base"]).is_integer(), "their rotary_base is an int"
    cfg = LorsaConfig(sae_type="lorsa", d_model=meta["d_model"], expansion_factor=meta["n_ov_heads"] / meta["d_model"],
                      n_qk_heads=meta["n_qk_heads"], d_qk_head=meta["d_qk_head"], rotary_dim=rot["rotary_dim"],
                      rotary_base=int(rot["base"]), rotary_adjacent_pairs=rot["interleaved"], n_ctx=meta["seq_len"],
                      attn_scale=1.0 / meta["scale"], hook_point_in=hook_in, hook_point_out=hook_out,
                      act_fn="topk", top_k=meta["top_k"], norm_activation="dataset-wise", device="cpu",
                      dtype=torch.float32, **rope)
    assert cfg.n_ov_heads == meta["n_ov_heads"]
    stream = Batches(train, hook_in, hook_out, steps)
    torch.manual_seed(seed)
    t0 = time.time()
    documented = spec["init"] == "documented"
    init_cfg = InitializerConfig(grid_search_init_norm=True, initialize_lorsa_with_mhsa=documented,
                                 initialize_W_D_with_active_subspace=documented, model_layer=layer,
                                 init_encoder_with_decoder_transpose=False)
    initializer = Initializer(init_cfg)
    # Initializer.initialize_sae_from_config, step by step (module docstring)
    sae = LowRankSparseAttention(cfg)
    sae = initializer.initialize_parameters(sae)
    sae.set_dataset_average_activation_norm(calculate_activation_norm(stream, cfg.associated_hook_points))
    batch0 = next(iter(stream))
    if documented:
        attn = their_attention(meta, mhsa)
        sae.init_lorsa_with_mhsa(attn)
        sae.init_W_V_with_active_subspace_per_head(batch=sae.normalize_activations(batch0), mhsa=attn)
    sae = initializer.initialization_search(sae, batch0)
    with torch.no_grad():
        fvu0 = _fvu(sae, sae.normalize_activations(batch0))
    init_s = time.time() - t0

    run = out / "runs" / name
    run.mkdir(parents=True, exist_ok=True)
    tc = {k: v for k, v in spec.items() if k != "init"}
    warmup = tc.pop("lr_warm_up_steps", warmup)
    trainer = Trainer(TrainerConfig(exp_result_path=str(run), total_training_tokens=steps * 16 * meta["seq_len"],
                                    lr_warm_up_steps=warmup, amp_dtype=torch.float32, skip_metrics_calculation=True,
                                    n_checkpoints=0, initial_k=tc.pop("initial_k", meta["top_k"]), **tc))
    sae.cfg.save_hyperparameters(run)  # train_lorsa: config.json before fit
    t1 = time.time()
    end_of_stream = trainer.fit(sae=sae, activation_stream=stream, eval_fn=None, wandb_logger=None)
    train_s = time.time() - t1
    assert not end_of_stream and trainer.cur_step == steps, (end_of_stream, trainer.cur_step)
    sae.save_pretrained(run, fold_activation_scale=True)  # train_lorsa's end
    with torch.no_grad():  # their folded module on raw held-out windows: what our load must reproduce
        acts = sae.encode(check_x)
        save_file({"x": check_x, "out": sae.decode(acts), "active": acts != 0}, str(run / "reference.safetensors"))
    row = {"variant": name, "steps": steps, "train_tokens": steps * 16 * meta["seq_len"], "spec": spec,
           "warmup": warmup, "init_s": round(init_s, 1), "train_s": round(train_s, 1), "fvu_at_init_batch0": fvu0,
           "dataset_norms": sae.dataset_average_activation_norm, "folder": str(run)}
    print(json.dumps(row), flush=True)
    return row


def _fvu(sae: Any, batch: dict[str, torch.Tensor]) -> float:
    """Masked FVU of their module on one normalised batch (a diagnostic: the init's starting point)."""
    y = batch[sae.cfg.hook_point_out]
    out = sae.decode(sae.encode(batch[sae.cfg.hook_point_in]))
    m = batch["mask"]
    ys = y[m].double()
    return float((y - out)[m].double().pow(2).sum() / (ys - ys.mean(0)).pow(2).sum())


def cmd_train(args: argparse.Namespace) -> None:
    from importlib.metadata import version

    torch.set_num_threads(1)
    d = Path(args.dir)
    meta = json.loads((d / "meta.json").read_text())
    train = load_file(str(d / "train.safetensors"))
    mhsa = load_file(str(d / "mhsa.safetensors"))
    steps = args.steps or meta["steps"]
    if steps > train["batch_windows"].shape[0]:
        raise SystemExit(f"{d} holds {train['batch_windows'].shape[0]} batches, not {steps}")
    check_x = load_file(str(d / "heldout.safetensors"))["x"][:4].contiguous()
    log = d / "runs" / "train.json"
    for v in args.variants.split(","):
        row = train_variant(v, VARIANTS[v], meta, train, mhsa, check_x, d, steps, args.warmup, args.seed)
        rows = json.loads(log.read_text())["rows"] if log.exists() else []
        rows = [r for r in rows if r["variant"] != v] + [row]  # one row per variant: the latest run
        log.write_text(json.dumps({"llamascopium": version("llamascopium"), "torch": torch.__version__,
                                   "rows": rows}, indent=1))


def cmd_measure(args: argparse.Namespace) -> None:
    from benchmarks.lorsa_recipe import heldout_metrics
    from nnsight_lorsa import formats

    torch.set_num_threads(1)
    d = Path(args.dir)
    meta = json.loads((d / "meta.json").read_text())
    held = HeldOut(load_file(str(d / "heldout.safetensors")))
    log = json.loads((d / "runs" / "train.json").read_text())
    rows = []
    for r in log["rows"]:
        lorsa = formats.load(r["folder"], format="llamascopium", weights_folded=True)
        row = {k: r[k] for k in ("variant", "steps", "train_tokens", "spec", "warmup", "init_s", "train_s",
                                  "fvu_at_init_batch0")}
        ref = load_file(str(Path(r["folder"]) / "reference.safetensors"))
        with torch.no_grad():
            out, cache = lorsa(ref["x"], return_cache=True)
        # our load vs their module's own output on raw held-out windows (relative to the output's norm)
        row["load_max_rel_err"] = float((out - ref["out"]).abs().max() / ref["out"].abs().max())
        row["load_same_active_frac"] = float((cache.active == ref["active"]).all(-1).float().mean())
        row.update(heldout_metrics(lorsa, held))  # type: ignore[arg-type]
        rows.append(row)
    print(f"| llamascopium {log['llamascopium']} variant | FVU | L0 | dead | FVU at init | train s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| `{row['variant']}` | {row['fvu']:.4f} | {row['l0']:.1f} | {100 * row['dead_frac']:.1f}% | "
              f"{row['fvu_at_init_batch0']:.3f} | {row['train_s']:.0f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"llamascopium": log["llamascopium"], "torch_peer": log["torch"],
                                              "layer": meta["layer"], "n_ov_heads": meta["n_ov_heads"],
                                              "top_k": meta["top_k"], "heldout_windows": meta["heldout_windows"],
                                              "rows": rows}, indent=1))


LABELS = {"recipe:lr=0.004;rank_by_decoder_norm=False;scale_into=w_v": "ours, scale in w_v (the default)",
          "recipe:lr=0.004;rank_by_decoder_norm=True;scale_into=w_o": "ours, scale in ||w_o|| (scale_into='w_o')",
          "recipe:lr=0.002;rank_by_decoder_norm=True;scale_into=w_o": "ours, scale in ||w_o||, lr 2e-3",
          "doc_lr4e-3": "llamascopium, documented init"}


def cmd_collect(args: argparse.Namespace) -> None:
    """Merge ``TAG-ours*.json`` (``lorsa_recipe --out``) and ``TAG-theirs.json`` (``measure --out``) of
    every ``TAG`` (``MODEL-L{layer}``) under ``dir`` into one JSON: one row per run, and per layer
    whether each of ours dominates theirs (FVU and dead fraction both lower or equal)."""
    d = Path(args.dir)
    rows: list[dict[str, Any]] = []
    layers: list[dict[str, Any]] = []
    for theirs_f in sorted(d.glob("*-theirs.json")):
        tag = theirs_f.name[: -len("-theirs.json")]
        model, layer = tag.rsplit("-L", 1)
        theirs = json.loads(theirs_f.read_text())
        all_ours = [json.loads(f.read_text()) for f in sorted(d.glob(f"{tag}-ours*.json"))]
        if not all_ours:
            continue
        meta = {"model": model, "model_type": next(iter(all_ours[0]["models"].values()))["model_type"],
                "layer": int(layer)}
        for ours in all_ours:
            for r in ours["rows"]:
                rows.append({**meta, "trainer": "ours", "variant": r["variant"], "label": LABELS.get(r["variant"]),
                             "steps": r["steps"], "fvu": r["fvu"], "dead_frac": r["dead_frac"], "l0": r["l0"],
                             "train_s": r["train_s"], "init": r["init"], "fvu_at": r["fvu_at"],
                             "command": "OMP_NUM_THREADS=1 PYTHONPATH=. " + ours["command"]})
        for r in theirs["rows"]:
            rows.append({**meta, "trainer": "llamascopium", "variant": r["variant"], "label": LABELS.get(r["variant"]),
                         "steps": r["steps"], "fvu": r["fvu"], "dead_frac": r["dead_frac"], "l0": r["l0"],
                         "train_s": r["train_s"], "load_max_rel_err": r["load_max_rel_err"],
                         "load_same_active_frac": r["load_same_active_frac"],
                         "fvu_at_init_batch0": r["fvu_at_init_batch0"]})
        here = [r for r in rows if r["model"] == model and r["layer"] == int(layer)]
        them = next(r for r in here if r["trainer"] == "llamascopium")
        entry = {**meta, "steps": them["steps"], "llamascopium": {"fvu": them["fvu"], "dead_frac": them["dead_frac"]}}
        for r in here:
            if r["trainer"] == "ours":
                entry[r["variant"]] = {"fvu": r["fvu"], "dead_frac": r["dead_frac"],
                                       "dominates_llamascopium": bool(r["fvu"] <= them["fvu"]
                                                                      and r["dead_frac"] <= them["dead_frac"]),
                                       "fvu_rel_to_llamascopium": r["fvu"] / them["fvu"] - 1,
                                       "dead_points_vs_llamascopium": 100 * (r["dead_frac"] - them["dead_frac"])}
        layers.append(entry)
    print("| model | layer | steps | trainer | FVU | dead | dominates llamascopium |")
    print("|---|---|---|---|---|---|---|")
    for e in layers:
        for r in (r for r in rows if r["model"] == e["model"] and r["layer"] == e["layer"]):
            dom = e.get(r["variant"], {}).get("dominates_llamascopium", "")
            print(f"| {e['model']} | {e['layer']} | {r['steps']} | {r['label'] or r['variant']} | {r['fvu']:.4f} | "
                  f"{100 * r['dead_frac']:.1f}% | {'yes' if dom is True else 'no' if dom is False else ''} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"notes": args.note or [], "layers": layers, "rows": rows}, indent=1))


class HeldOut:
    """The exported held-out windows, read like an ``ActivationCache`` by ``heldout_metrics``."""

    def __init__(self, t: dict[str, torch.Tensor]) -> None:
        self.t, self.n_windows = t, int(t["x"].shape[0])

    def windows(self, key: str, index: torch.Tensor) -> torch.Tensor:
        return self.t[key][index]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="their venv: train and save each variant with llamascopium")
    t.add_argument("dir")
    t.add_argument("--variants", default="doc_lr4e-3,doc_lr2e-4", help=f"comma-separated of {', '.join(VARIANTS)}")
    t.add_argument("--steps", type=int, default=0, help="default: the exported steps")
    t.add_argument("--warmup", type=float, default=0.05, help="lr warm-up: fraction of the steps (<1) or steps")
    t.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("measure", help="our env: load each saved Lorsa with our loader, held-out metrics")
    m.add_argument("dir")
    m.add_argument("--out", default=None)
    c = sub.add_parser("collect", help="merge the per-layer JSONs of ours and theirs (cmd_collect)")
    c.add_argument("dir")
    c.add_argument("--out", default=None)
    c.add_argument("--note", action="append", help="a line for the JSON's notes (repeatable)")
    args = p.parse_args()
    if args.cmd == "collect":
        cmd_collect(args)
    elif args.cmd == "train":
        if args.warmup >= 1:
            args.warmup = int(args.warmup)
        cmd_train(args)
    else:
        cmd_measure(args)


if __name__ == "__main__":
    main()
