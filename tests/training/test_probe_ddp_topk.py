"""DDP probe: BatchTopK's threshold, the SAE objective, the Lorsa remedies that edit weights from one batch, resume.

On 2 gloo CPU processes (run as a script by the tests: ``python THIS RANK WORLD INIT_FILE OUT_PREFIX MODE``), each
against one process on the concatenated (global) batches:

* ``batchtopk``: a BatchTopK SAE (fp64, sparse kernels and dense; a bf16 one without master weights). The ranks'
  thresholds must be equal (bit for bit) and within a relative bound of the one process's: the batch rule stays
  per rank (``k · n`` of the rank's rows), and the threshold's statistic is the mean of the ranks' smallest kept
  activations where one process takes the smallest of the global top ``k · N``. Until 2026-11-27 each rank's
  threshold followed its own shard (the ranks' saved thresholds differed).
* ``kinds``: an SAE (TopK, AuxK) and a skip transcoder with a BatchTopK: parameters, Adam moments, dead counters.
* ``resume``: 2 steps, checkpoint (rank 0), resume on both ranks, 2 more: equal to 4 steps straight.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers import run_ranks

DT = torch.float64
D, F, STEPS = 6, 24, 4


def _batch(index: int, dtype: torch.dtype = DT):
    from nnsight_lorsa.training.activations import Batch

    g = torch.Generator().manual_seed(300 + index)
    x = torch.randn(6, 7, D, generator=g, dtype=DT) * 2 + 0.3
    y = torch.tanh(x @ torch.randn(D, D, generator=g, dtype=DT) / math.sqrt(D)) \
        + 0.1 * torch.randn(6, 7, D, generator=g, dtype=DT)
    lengths = torch.tensor([7, 7, 6, 3, 2, 4])  # the second rank's windows are mostly padding
    mask = torch.arange(7)[None] < lengths[:, None]
    mask[:, 0] = False
    return Batch(x.to(dtype), y.to(dtype), mask)


def _sae_batch(index: int, dtype: torch.dtype = DT):
    from nnsight_lorsa.training.activations import Batch

    b = _batch(index, dtype)
    return Batch(b.x, b.x, b.loss_mask)


#: (name, module kind, activation, params, dtype, sparse kernels, master weights)
RUNS = {
    "batchtopk_sparse": ("sae", "batchtopk", {"k": 3}, DT, True, True),
    "batchtopk_dense": ("sae", "batchtopk", {"k": 3}, DT, False, True),
    "batchtopk_bf16": ("sae", "batchtopk", {"k": 3}, torch.bfloat16, True, False),
    "sae_topk": ("sae", "topk", {"k": 3}, DT, True, True),
    "transcoder_batchtopk": ("skip_transcoder", "batchtopk", {"k": 3}, DT, False, True),
}


#: the Lorsa dead-head remedies probed under DDP
REMEDIES = ("revive", "resample", "ghost")


def make_lorsa_trainer(remedy: str):
    from nnsight_lorsa.modules.lorsa import Lorsa
    from nnsight_lorsa.modules.lorsa_config import LorsaConfig
    from nnsight_lorsa.training import LorsaObjective, LorsaRecipe, TrainConfig, Trainer
    from nnsight_lorsa.training.activations import Batch

    def source(i):
        b = _batch(i)
        return Batch(b.x, b.y, b.loss_mask, torch.arange(7), (torch.arange(7)[None] <= b.loss_mask.sum(1)[:, None]))

    torch.manual_seed(0)
    lorsa = Lorsa(LorsaConfig(d_model=D, n_qk_heads=2, d_qk_head=3, n_ov_heads=8, top_k=2)).to(DT)
    recipe = LorsaRecipe(ov_init="random", dead_remedy=remedy, remedy_until=1.0, rank_by_decoder_norm=False)
    cfg = TrainConfig(total_steps=STEPS, lr=2e-2, norm_batches=2, dead_after_tokens=8, grad_clip=1.0)
    return Trainer(LorsaObjective(lorsa, recipe=recipe), source, cfg)


def make_trainer(name: str, steps: int = STEPS):
    from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
    from nnsight_lorsa.modules.transcoder import SkipTranscoder, TranscoderConfig
    from nnsight_lorsa.training import TrainConfig, Trainer

    kind, act, params, dtype, sparse, masters = RUNS[name]
    torch.manual_seed(0)
    if kind == "sae":
        module = SparseAutoencoder(SAEConfig(d_in=D, d_sae=F, activation=act, activation_params=params))
        source = lambda i: _sae_batch(i, dtype)  # noqa: E731
    else:
        module = SkipTranscoder(TranscoderConfig(d_in=D, d_sae=F, activation=act, activation_params=params))
        source = lambda i: _batch(i, dtype)  # noqa: E731
    cfg = TrainConfig(total_steps=steps, lr=2e-2, norm_batches=2, dead_after_tokens=8, aux_k_coef=0.5,
                      grad_clip=1.0, sparse_kernels=sparse, master_weights=masters)
    return Trainer(module.to(dtype), source, cfg)


def state(trainer) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone().contiguous() for k, v in trainer.module.named_parameters()}
    out.update({f"buffer.{k}": v.detach().clone().contiguous() for k, v in trainer.module.named_buffers()})
    for n, p in trainer.module.named_parameters():
        for slot in ("exp_avg", "exp_avg_sq"):
            if slot in trainer.optimizer.state.get(trainer.masters.held(p), {}):
                out[f"{slot}.{n}"] = trainer.optimizer.state[trainer.masters.held(p)][slot].clone()
    out["tokens_since_fired"] = trainer.tokens_since_fired.clone()
    return out


def _worker(rank: int, world: int, init_file: str, out_prefix: str, mode: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from nnsight_lorsa.training import Trainer
    from nnsight_lorsa.training.distributed import DataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if mode == "lorsa":
            for remedy in REMEDIES:
                trainer = make_lorsa_trainer(remedy)
                DataParallel(trainer)
                trainer.train(progress=False)
                save_file(state(trainer), f"{out_prefix}_lorsa_{remedy}.safetensors")
            return
        if mode == "raise":  # rank 1's source raises at step 2: every rank must end in a named error
            from nnsight_lorsa.errors import LorsaError, ShapeError

            trainer = make_trainer("transcoder_batchtopk")

            def source(i, plain=trainer.source):
                if i == 2 and rank == 1:
                    raise ShapeError("step 2: a bad batch on rank 1")
                return plain(i)

            trainer.source = source
            DataParallel(trainer)
            try:
                trainer.train(progress=False)
            except LorsaError as e:
                with open(f"{out_prefix}.error", "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
            return
        names = [n for n in RUNS if n.startswith("batchtopk")] if mode == "batchtopk" else list(RUNS)
        for name in names:
            trainer = make_trainer(name)
            DataParallel(trainer)
            trainer.train(progress=False)
            save_file(state(trainer), f"{out_prefix}_{name}.safetensors")
        if mode == "kinds":  # resume under DDP: 2 steps, checkpoint (rank 0 writes), resume, 2 more
            trainer = make_trainer("transcoder_batchtopk")
            DataParallel(trainer)
            trainer.train(2, progress=False)
            ck = init_file + ".ck"
            if rank == 0:
                trainer.save_checkpoint(ck)
            dist.barrier()
            again = Trainer.resume(ck, make_trainer("transcoder_batchtopk").source)
            DataParallel(again)
            again.train(progress=False)
            save_file(state(again), f"{out_prefix}_resumed.safetensors")
    finally:
        dist.destroy_process_group()


def _single(names):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers
    try:
        out = {}
        for name in names:
            t = make_trainer(name)
            t.train(progress=False)
            out[name] = state(t)
        return out
    finally:
        torch.set_num_threads(threads)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= rel * max(float(b.norm()), 1e-30))


@pytest.mark.slow  # two processes start (~10 s on 2 busy cores)
def test_two_gloo_ranks_hold_one_batchtopk_threshold_near_the_global_batch_one(tmp_path):
    from safetensors.torch import load_file

    run_ranks(__file__, 2, tmp_path, ("batchtopk",), timeout=300)
    names = [n for n in RUNS if n.startswith("batchtopk")]
    single = _single(names)
    for name in names:
        ranks = [load_file(str(tmp_path / f"rank{r}_{name}.safetensors")) for r in range(2)]
        theta = [r["buffer.activation.threshold"] for r in ranks]
        assert torch.equal(theta[0], theta[1]), (name, theta)  # one estimate on every rank
        assert torch.equal(ranks[0]["buffer.activation.n_updates"], ranks[1]["buffer.activation.n_updates"])
        want = single[name]["buffer.activation.threshold"]
        # the statistic is a mean of the ranks' smallest kept activations, not the global one: a few % apart here
        assert _close(theta[0], want, 0.1), (name, float(theta[0]), float(want))


@pytest.mark.slow  # two processes start (~10 s on 2 busy cores)
def test_two_gloo_ranks_equal_one_process_for_an_sae_and_a_batchtopk_transcoder_and_resume(tmp_path):
    from safetensors.torch import load_file

    run_ranks(__file__, 2, tmp_path, ("kinds",), timeout=300)
    single = _single(["sae_topk", "transcoder_batchtopk"])
    for name in ("sae_topk", "transcoder_batchtopk"):
        ranks = [load_file(str(tmp_path / f"rank{r}_{name}.safetensors")) for r in range(2)]
        for key, want in single[name].items():
            assert torch.equal(ranks[0][key], ranks[1][key]), (name, key)
            if name == "sae_topk":  # TopK per row: the same as one process (BatchTopK: per rank, not global)
                assert _close(ranks[0][key], want, 1e-8), (name, key)
    resumed = [load_file(str(tmp_path / f"rank{r}_resumed.safetensors")) for r in range(2)]
    straight = load_file(str(tmp_path / "rank0_transcoder_batchtopk.safetensors"))
    for key, want in straight.items():
        assert torch.equal(resumed[0][key], resumed[1][key]), key
        assert torch.equal(resumed[0][key], want), key


@pytest.mark.slow  # two processes start (~10 s on 2 busy cores)
def test_two_gloo_ranks_hold_one_lorsa_under_every_remedy(tmp_path):
    """The remedies that edit weights from one batch (``revive``: the dead heads' ``z_pre``, ``resample``: a drawn
    token) must leave the same Lorsa on every rank."""
    from safetensors.torch import load_file

    run_ranks(__file__, 2, tmp_path, ("lorsa",), timeout=300)
    for remedy in REMEDIES:
        ranks = [load_file(str(tmp_path / f"rank{r}_lorsa_{remedy}.safetensors")) for r in range(2)]
        for key in ranks[0]:
            assert torch.equal(ranks[0][key], ranks[1][key]), (remedy, key)


@pytest.mark.slow  # two processes start (~10 s on 2 busy cores)
def test_a_rank_raising_mid_run_ends_every_rank_in_a_named_error(tmp_path):
    """Rank 1's source raises at step 2 (a rank-local error, before any collective of the step): rank 0 must not
    wait for it in a collective, and both end in a named error (rank 0's names the failed rank)."""
    run_ranks(__file__, 2, tmp_path, ("raise",), timeout=120)
    errors = [(tmp_path / f"rank{r}.error").read_text() for r in range(2)]
    assert errors[1].startswith("ShapeError: step 2: a bad batch on rank 1"), errors
    assert "rank 1" in errors[0] and "step 2" in errors[0], errors


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
