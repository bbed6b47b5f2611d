"""Training-step probe, part 3: DDP on 2 gloo CPU processes equals one process for the kinds
``tests/training/test_distributed.py`` does not train there.

That test covers a TopK (sparse kernels, AuxK) and a ReLU + L1 skip transcoder in fp32. Here, in fp64 (so that
the bound can be tight), on windows whose padding gives the two ranks unequal token counts: JumpReLU (the L0
term), AbsTopK (signed AuxK) and GroupMax (AuxK) skip transcoders, a 2-layer TopK CLT with AuxK (its source
shards the windows, dim 1 of the stacked batch), a Lorsa with the default recipe (data-driven init from the
global batch 0, ``‖w_o‖`` ranking, head balancing with firing counts combined over the ranks) and one with
AuxK and ``w_o`` renormalised. Each rank's parameters, Adam moments and dead counters after 4 steps must equal
the one-process run's on the global batches (1e-8 of the norm; a Lorsa's ``b_K``, whose exact gradient is 0,
1e-6). Run as a script by the test (``python THIS RANK WORLD INIT_FILE OUT_PREFIX``).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers import run_ranks

DT = torch.float64
KINDS = ("jumprelu", "abstopk", "groupmax", "clt", "lorsa", "lorsa_auxk")
D, STEPS = 6, 4


def _batch(index: int, layers: int = 0, lorsa: bool = False):
    from nnsight_lorsa.training.activations import Batch

    g = torch.Generator().manual_seed(100 + index)
    lead = (layers,) if layers else ()
    x = torch.randn(*lead, 6, 7, D, generator=g, dtype=DT) * 2 + 0.3
    y = torch.tanh(x @ torch.randn(D, D, generator=g, dtype=DT) / math.sqrt(D)) \
        + 0.1 * torch.randn(*lead, 6, 7, D, generator=g, dtype=DT)
    lengths = torch.tensor([7, 7, 6, 3, 2, 4])  # the second rank's windows (3..5) are mostly padding
    real = torch.arange(7)[None] < lengths[:, None]
    mask = real.clone()
    mask[:, 0] = False
    if lorsa:
        return Batch(x, y, mask, torch.arange(7), real.long())
    return Batch(x, y, mask)


class StackedSource:
    """A CLT's global batches, sharded along the windows (dim 1 of ``x`` / ``y``)."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world

    def __call__(self, index: int):
        from nnsight_lorsa.training.activations import Batch

        b = _batch(index, layers=2)
        if self.world == 1:
            return b
        cut = lambda t, dim: t.tensor_split(self.world, dim=dim)[self.rank]  # noqa: E731
        return Batch(cut(b.x, 1), cut(b.y, 1), cut(b.loss_mask, 0))

    def shard(self, rank: int, world: int) -> StackedSource:
        return StackedSource(rank, world)


def make_trainer(kind: str):
    from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
    from nnsight_lorsa.modules.lorsa import Lorsa
    from nnsight_lorsa.modules.lorsa_config import LorsaConfig
    from nnsight_lorsa.modules.transcoder import SkipTranscoder, TranscoderConfig
    from nnsight_lorsa.training import LorsaObjective, LorsaRecipe, TrainConfig, Trainer

    torch.manual_seed(0)
    cfg = TrainConfig(total_steps=STEPS, lr=2e-2, norm_batches=2, dead_after_tokens=8, warmup_frac=0.25,
                      aux_k_coef=0.5, l0_coef=0.05, grad_clip=1.0, log_every=1)
    if kind == "clt":
        module = CrossLayerTranscoder(CLTConfig(d_in=D, d_sae=16, n_layers=2, activation="topk",
                                                activation_params={"k": 2})).to(DT)
        return Trainer(module, StackedSource(), cfg)
    if kind.startswith("lorsa"):
        lorsa = Lorsa(LorsaConfig(d_model=D, n_qk_heads=2, d_qk_head=3, n_ov_heads=8, top_k=2)).to(DT)
        recipe = LorsaRecipe(ov_init="random", dead_remedy="auxk", rank_by_decoder_norm=False) \
            if kind == "lorsa_auxk" else LorsaRecipe(ov_init="random")
        return Trainer(LorsaObjective(lorsa, recipe=recipe), lambda i: _batch(i, lorsa=True), cfg)
    params = {"jumprelu": {"threshold": 0.1, "bandwidth": 0.5}, "abstopk": {"k": 3}, "groupmax": {"k": 4}}[kind]
    coder = SkipTranscoder(TranscoderConfig(d_in=D, d_sae=16, activation=kind, activation_params=params)).to(DT)
    with torch.no_grad():
        coder.W_skip.normal_(0, 0.1)
    return Trainer(coder, _batch, cfg)


def state(trainer) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone().contiguous() for k, v in trainer.module.named_parameters()}
    for n, p in trainer.module.named_parameters():
        for slot in ("exp_avg", "exp_avg_sq"):
            if slot in trainer.optimizer.state.get(p, {}):  # (none before the first step)
                out[f"{slot}.{n}"] = trainer.optimizer.state[p][slot].clone()
    out["tokens_since_fired"] = trainer.tokens_since_fired.clone()
    return out


def _worker(rank: int, world: int, init_file: str, out_prefix: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from nnsight_lorsa.training.distributed import DataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for kind in KINDS:
            trainer = make_trainer(kind)
            DataParallel(trainer)
            hist = trainer.train(progress=False)
            aux = torch.tensor([max(h.get("aux", 0.0) for h in hist)], dtype=DT)
            save_file({**state(trainer), "max_aux": aux}, f"{out_prefix}_{kind}.safetensors")
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path, world: int, timeout: float = 180) -> None:
    """:func:`_worker` in ``world`` processes (:func:`helpers.run_ranks`: logs in files, no rank left)."""
    run_ranks(__file__, world, tmp_path, timeout=timeout)


@pytest.mark.slow  # 10 s (two processes start): tests/training/test_distributed.py is the default run's DDP test
def test_two_gloo_processes_equal_one_process_for_every_other_kind(tmp_path):
    from safetensors.torch import load_file

    _run_ranks(tmp_path, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for kind in KINDS:
            single = make_trainer(kind)
            hist = single.train(progress=False)
            want = state(single)
            if kind in ("abstopk", "groupmax", "clt", "lorsa_auxk"):
                assert any(h["aux"] > 0 for h in hist), kind  # AuxK took part
            start = state(make_trainer(kind))
            for r in range(2):
                got = load_file(str(tmp_path / f"rank{r}_{kind}.safetensors"))
                for name, value in want.items():
                    if value.dtype == torch.long:
                        assert torch.equal(got[name], value), (kind, name, r)
                        continue
                    tol = 1e-6 if name.endswith("b_K") else 1e-8
                    scale = max(float(value.norm()), 1e-6 if name.startswith("exp_avg") else 0.1)
                    err = float((got[name] - value).norm()) / scale
                    assert err <= tol, (kind, name, r, err)
            assert not torch.equal(want["W_O" if kind.startswith("lorsa") else "W_enc"],
                                   start["W_O" if kind.startswith("lorsa") else "W_enc"])  # training moved it
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
