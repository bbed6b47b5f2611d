"""Cost of training's non-finite guards (issue 23) on the embedded demo config, and proof they change no number.

Two trainers, the same initialisation, the same batches: one steps with :meth:`Trainer.train_step` (guarded:
the loss checked on the float its metrics already hold, the gradient norm computed once — clipping's own —
and checked, the learning rate checked, the dead counters copied so a refused step can put them back), the
other with the step as it was before the guards (below, verbatim). Steps alternate between the two (noise
hits both alike); the per-step medians are reported, and the two trainers' weights, Adam state and dead
counters must end bit-equal.

The batches (the demo's: layer 2 of the embedded model, 16 windows x 128 tokens, the demo's Lorsa — 1024 OV
heads, top-k 16, 16 QK heads x 32 — and lr 4e-3) are collected once before timing, so the model's forward does
not blur the comparison: the overhead is relative to the optimisation step alone (the demo's real step,
with the forward through nnsight, is longer).

    python -m benchmarks.bench_training_guards [--steps 60] [--device cpu] [--threads 2]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks._embedded import embedded_layer
from benchmarks._timing import command, parser, start, write
from nnsight_lorsa.demo import DemoConfig
from nnsight_lorsa.modules.lorsa import Lorsa
from nnsight_lorsa.modules.lorsa_config import LorsaConfig
from nnsight_lorsa.training import ActivationSource, LorsaObjective, TrainConfig, Trainer


def unguarded_step(self: Trainer) -> dict[str, float]:
    """``Trainer.train_step`` before the guards (commit 717af56), verbatim."""
    if self.s_in is None:
        self.estimate_norms()
    if self.dist is None:
        loss, metrics = self.loss(self.source(self.step))
    else:
        loss, metrics = self.dist.loss(self.step)
    self.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if self.config.grad_clip:
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.grad_clip)
    self.optimizer.step()
    self.scheduler.step()
    self.objective.post_step(self)
    self.step += 1
    metrics["lr"] = float(self.scheduler.get_last_lr()[0])
    return metrics


def state(t: Trainer) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": v.detach().cpu() for k, v in t.module.state_dict().items()}
    names = {id(p): n for n, p in t.module.named_parameters()}
    for p, s in t.optimizer.state.items():
        out.update({f"adam.{names[id(p)]}.{k}": v.detach().cpu() for k, v in s.items()})
    out["counters"] = t.tokens_since_fired.cpu()
    return out


def main() -> None:
    args = parser(__doc__, steps=60, device="cpu", threads=2).parse_args()
    start(args)
    demo = DemoConfig()
    model, adapter, layer, mhsa, train = embedded_layer(demo.seq_len)
    live = ActivationSource.attention(model, layer, train, demo.batch_size, seed=demo.seed)
    batches = [live(i).to(torch.device(args.device), torch.float32) for i in range(args.steps)]

    def source(i: int) -> Any:
        return batches[i]

    lcfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=8 * adapter.d_model, top_k=demo.top_k,
                                 qk_heads_per_mhsa_head=demo.qk_heads_per_mhsa_head, layer=layer)
    trainers = {}
    for name in ("guarded", "unguarded"):
        torch.manual_seed(0)
        trainers[name] = Trainer(LorsaObjective(Lorsa(lcfg, device=args.device), mhsa=mhsa),
                                 source, TrainConfig(total_steps=demo.steps, lr=demo.lr))
        trainers[name].estimate_norms()  # the recipe's init draws from the global generator: seeded for each
    steps = {"guarded": Trainer.train_step, "unguarded": unguarded_step}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(args.steps):
        for name, fn in (steps.items() if i % 2 else reversed(steps.items())):
            sync()
            t0 = time.perf_counter()
            fn(trainers[name])
            sync()
            if i >= 2:  # warm-up: not timed
                times[name].append(time.perf_counter() - t0)
    a, b = state(trainers["guarded"]), state(trainers["unguarded"])
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["guarded"] / med["unguarded"] - 1
    print(f"per step (median of {len(times['guarded'])}): guarded {med['guarded'] * 1e3:.2f} ms, "
          f"unguarded {med['unguarded'] * 1e3:.2f} ms, overhead {overhead:+.2%}; "
          f"states bit-equal after {args.steps} steps: {equal}")
    write(f"training_guards_{args.device.split(':')[0]}", {
        "command": command(), "steps": args.steps, "median_step_s": med, "overhead": overhead,
        "bit_equal": equal, "times_s": times})
    if not equal:
        raise SystemExit("the guarded and unguarded runs differ")


if __name__ == "__main__":
    main()
