"""bf16 training through fp32 master weights against fp32 and against bf16 without masters, per module kind.

On the embedded model (layer ``n_layers // 2``, windows of the shipped corpus): a TopK SAE (residual stream), a
TopK transcoder (MLP), a TopK CLT (every layer) and a Lorsa (``LorsaRecipe()``, initialised from the layer's MHSA),
each trained from one init (drawn in fp32, rounded to bf16 so that every variant starts from the same weights; a
Lorsa's data-driven init from the same seed) and on the same batches (``min(steps, 100)`` batches of ``--batch``
windows x ``--seq-len`` tokens, cycled) as

* ``fp32``: an fp32 module;
* ``bf16_old``: a bf16 module with Adam on its bf16 weights (``TrainConfig(master_weights=False)``: the path before
  master weights, kept as an opt-out);
* ``bf16_masters``: a bf16 module through fp32 master weights (the default).

Reported per kind and variant: the share of entries updated over 5 steps at lr 1e-4 (of the module's weights, and
of the training state: the masters where there are some), the held-out FVU (the trainer's loss on held-out
batches, normalised space, the module's own dtype) after ``--steps`` steps at lr 1e-4 and 1e-3 (constant lr after
a 5 % warmup), the median step time (batches collected beforehand: the optimisation step alone; the three variants'
steps interleaved) and the bytes per trained parameter the training holds (weights + masters + Adam moments, summed
over the actual tensors).

    python -m benchmarks.training_bf16_masters [--steps 200] [--threads 2] [--kinds sae transcoder clt lorsa]
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from benchmarks._embedded import embedded_layer
from benchmarks._timing import arg, command, parser, start, write
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.lorsa import Lorsa
from nnsight_lorsa.modules.lorsa_config import LorsaConfig
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, LorsaObjective, LorsaRecipe, TokenDataset, TrainConfig, Trainer

VARIANTS = {"fp32": (torch.float32, True), "bf16_old": (torch.bfloat16, False), "bf16_masters": (torch.bfloat16, True)}
HELDOUT = 4  # held-out batches the FVU is measured on


def _modules(adapter: Any, mhsa: Any, layer: int, kind: str) -> torch.nn.Module:
    """A fresh fp32 module of ``kind`` (seeded: the same draw every call)."""
    torch.manual_seed(0)
    d = adapter.d_model
    topk = {"activation": "topk", "activation_params": {"k": 16}}
    if kind == "sae":
        return SparseAutoencoder(SAEConfig(d_in=d, d_sae=8 * d, hook=adapter.layer_path(layer), **topk))
    if kind == "transcoder":
        return Transcoder(TranscoderConfig(d_in=d, d_sae=8 * d, layer=layer, **topk))
    if kind == "clt":
        return CrossLayerTranscoder(CLTConfig(d_in=d, d_sae=4 * d, n_layers=adapter.n_layers, **topk))
    return Lorsa(LorsaConfig.from_mhsa(mhsa, n_ov_heads=8 * d, top_k=16, qk_heads_per_mhsa_head=4, layer=layer))


def _batches(model: Any, adapter: Any, layer: int, kind: str, data: TokenDataset, n: int, batch: int) -> list[Any]:
    if kind == "sae":
        source = ActivationSource.sae(model, Site.resid_post(adapter, layer), data, batch_size=batch)
    elif kind == "transcoder":
        source = ActivationSource.transcoder(model, layer, data, batch_size=batch)
    elif kind == "clt":
        source = ActivationSource.clt(model, data, batch_size=batch)
    else:
        source = ActivationSource.attention(model, layer, data, batch_size=batch)
    return [source(i) for i in range(n)]


def _trainer(kind: str, base: torch.nn.Module, mhsa: Any, batches: list[Any], variant: str, steps: int,
             lr: float) -> Trainer:
    dtype, masters = VARIANTS[variant]
    module = copy.deepcopy(base).to(torch.bfloat16).to(dtype)
    torch.manual_seed(1)
    trained = LorsaObjective(module, mhsa=mhsa, recipe=LorsaRecipe()) if kind == "lorsa" else module
    n_train = len(batches) - HELDOUT
    config = TrainConfig(total_steps=steps, lr=lr, warmup_frac=0.05, decay_frac=0.0, norm_batches=4,
                         master_weights=masters, log_every=max(1, steps))
    trainer = Trainer(trained, lambda i: batches[i % n_train], config)
    trainer.estimate_norms()  # now: a Lorsa's init draws from the generator just seeded, whatever runs next
    return trainer


def _state(trainer: Trainer, held: bool) -> dict[str, torch.Tensor]:
    """Each parameter's value (the module's weight, or with ``held`` what the optimizer steps), as a copy."""
    return {n: (trainer.masters.held(p) if held else p).detach().clone() for n, p in trainer.module.named_parameters()}


def _moved(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return sum(int((after[n] != before[n]).sum()) for n in after) / sum(v.numel() for v in after.values())


def _bytes_per_parameter(trainer: Trainer) -> float:
    params = list(trainer.module.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(m.numel() * m.element_size() for m in trainer.masters.masters())
    total += sum(v.numel() * v.element_size() for st in trainer.optimizer.state.values() for k, v in st.items()
                 if k != "step")
    return total / sum(p.numel() for p in params)


def _heldout_fvu(trainer: Trainer, batches: list[Any]) -> float:
    with torch.no_grad():
        return statistics.mean(trainer.loss(b)[1]["fvu"] for b in batches[-HELDOUT:])


def main() -> None:
    args = parser(__doc__, steps=200, threads=2, batch=8, seq_len=64,
                  kinds=arg(nargs="+", type=str, default=["sae", "transcoder", "clt", "lorsa"]),
                  name=arg("training_bf16_masters", "results/<name>.json")).parse_args()
    start(args)
    model, adapter, layer, mhsa, data = embedded_layer(args.seq_len)
    n_batches = min(args.steps, 100) + HELDOUT
    results: dict[str, Any] = {}
    for kind in args.kinds:
        batches = _batches(model, adapter, layer, kind, data, n_batches, args.batch)
        base = _modules(adapter, mhsa, layer, kind)
        out: dict[str, Any] = {"n_parameters": sum(p.numel() for p in base.parameters())}
        rows: dict[str, dict[str, Any]] = {variant: {} for variant in VARIANTS}
        for variant, row in rows.items():
            t = _trainer(kind, base, mhsa, batches, variant, 5, 1e-4)
            w0, h0 = _state(t, False), _state(t, True)
            t.train(progress=False)
            row["moved_5_steps_lr1e-4"] = {"weights": _moved(_state(t, False), w0),
                                           "trained": _moved(_state(t, True), h0)}
        for lr in (1e-4, 1e-3):
            trainers = {v: _trainer(kind, base, mhsa, batches, v, args.steps, lr) for v in VARIANTS}
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for i in range(args.steps):  # the variants' steps interleaved (rotating order): noise hits all alike
                order = list(VARIANTS)[i % 3:] + list(VARIANTS)[:i % 3]
                for v in order:
                    t0 = time.perf_counter()
                    trainers[v].train_step()
                    times[v].append(time.perf_counter() - t0)
            for v, t in trainers.items():
                rows[v][f"heldout_fvu_lr{lr:g}"] = _heldout_fvu(t, batches)
                rows[v][f"median_step_s_lr{lr:g}"] = statistics.median(times[v][2:])
                rows[v]["bytes_per_parameter"] = _bytes_per_parameter(t)
        for variant, row in rows.items():
            out[variant] = row
            print(kind, variant, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        results[kind] = out
    write(args.name, {"command": command(), "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
                      "layer": layer, "threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
