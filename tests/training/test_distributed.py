"""DDP on 2 CPU processes (gloo) gives the parameters of 1 process on the same global batch.

The tests run this file as a script in subprocesses (``python tests/test_distributed.py RANK WORLD
INIT_FILE OUT_PREFIX MODE``, :func:`_run_ranks`). ``train`` (2 ranks): each trains a TopK skip transcoder
(sparse kernels, AuxK active) and a ReLU+L1 one on its half of every global batch of a synthetic source
(ranks hold different numbers of loss tokens) and writes the final states as safetensors. ``grads`` (3 ranks):
each writes its own gradient of batch 0 and the one DDP reduced, for a bf16 and an fp32 module. ``hang``: the
launcher's own test (a rank that fails, one that never ends).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from helpers import run_ranks

D, F, K, STEPS = 24, 96, 4, 6
KINDS = ("topk", "relu")


def global_batch(index: int):
    """Global batch ``index``: 6 windows x 9 positions; rows of unequal token counts (padding)."""
    from nnsight_lorsa.training.activations import Batch

    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(6, 9, D, generator=g)
    y = torch.tanh(x @ torch.randn(D, D, generator=g) / 4) + 0.1 * torch.randn(6, 9, D, generator=g)
    mask = torch.ones(6, 9, dtype=torch.bool)
    mask[:, 0] = False
    mask[4:, 6:] = False  # the second rank's windows are partly padding: unequal token counts
    return Batch(x=x, y=y, loss_mask=mask)


NAN_STEP = 3


def nan_on_rank_1(index: int):
    """:func:`global_batch` with a NaN at step ``NAN_STEP`` in the second rank's half only."""
    b = global_batch(index)
    if index == NAN_STEP:
        b.x[4, 2, 0] = float("nan")
    return b


def make_trainer(kind: str = "topk", dtype: torch.dtype = torch.float32):
    from nnsight_lorsa.modules.transcoder import SkipTranscoder, TranscoderConfig
    from nnsight_lorsa.training import TrainConfig, Trainer

    torch.manual_seed(0)
    params = {"k": K} if kind == "topk" else {}
    coder = SkipTranscoder(TranscoderConfig(d_in=D, d_sae=F, activation=kind, activation_params=params)).to(dtype)
    cfg = TrainConfig(total_steps=STEPS, lr=1e-2, norm_batches=2, dead_after_tokens=60, warmup_frac=0.2,
                      l1_coef=1e-2)
    return Trainer(coder, global_batch, cfg)


def state(trainer) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone().contiguous() for k, v in trainer.module.state_dict().items()}
    out["tokens_since_fired"] = trainer.tokens_since_fired.clone()
    out.update({f"master.{n}": m.detach().clone() for n, m in trainer.masters.named(trainer.module).items()})
    return out


def _reduced_grads(out_prefix: str) -> None:
    """Writes, for a bf16 and an fp32 ReLU skip transcoder under DDP: this rank's own gradient of batch 0
    (``local.*``, a backward under ``no_sync``), the gradient the optimizer gets from DDP's reduced one
    (``reduced.*``: the masters' after ``move_grads``; an fp32 module's own) and the number of comm hooks
    (``{out_prefix}_bf16`` / ``_fp32.safetensors``); and for :class:`_Mixed` under plain DDP, its own gradients and
    the reduced ones without (``False.*``) and with (``True.*``) :func:`fp32_mean_hook` (``_mixed.safetensors``)."""
    from safetensors.torch import save_file

    from nnsight_lorsa.training.distributed import DataParallel

    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        trainer = make_trainer("relu", dtype)
        dp = DataParallel(trainer)
        trainer.estimate_norms()
        counters = trainer.tokens_since_fired.clone()
        with dp.ddp.no_sync():
            dp.loss(0)[0].backward()
        out = {f"local.{n}": p.grad.detach().clone() for n, p in trainer.module.named_parameters()}
        trainer.module.zero_grad(set_to_none=True)
        trainer.tokens_since_fired = counters  # the second forward sees the first's state
        dp.loss(0)[0].backward()
        trainer.masters.move_grads()
        out |= {f"reduced.{n}": trainer.masters.held(p).grad.detach().clone()
                for n, p in trainer.module.named_parameters()}
        out["hooks"] = torch.tensor([len(dp.ddp._comm_hooks)])
        save_file(out, f"{out_prefix}_{name}.safetensors")
    # a module with a bf16 and an fp32 parameter (DDP buckets hold one dtype each), with and without the hook
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nnsight_lorsa.training.distributed import fp32_mean_hook

    x = torch.randn(64, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {}
    for hooked in (False, True):
        ddp = DistributedDataParallel(_Mixed())
        if hooked:
            ddp.register_comm_hook(None, fp32_mean_hook)
        with ddp.no_sync():
            ddp(x).backward()
        out |= {f"local.{n}": p.grad.clone() for n, p in ddp.module.named_parameters()}
        ddp.zero_grad(set_to_none=True)
        ddp(x).backward()
        out |= {f"{hooked}.{n}": p.grad.clone() for n, p in ddp.module.named_parameters()}
    save_file(out, f"{out_prefix}_mixed.safetensors")


class _Mixed(torch.nn.Module):
    """A bf16 and an fp32 parameter, ``(64,)`` each: ``Σ (x·low)² + Σ (x·high)²``, the first term in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.low = torch.nn.Parameter(torch.linspace(0.5, 2.0, 64).to(torch.bfloat16))
        self.high = torch.nn.Parameter(torch.linspace(0.5, 2.0, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.bfloat16) * self.low).pow(2).sum().float() + (x * self.high).pow(2).sum()


def _worker(rank: int, world: int, init_file: str, out_prefix: str, mode: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from nnsight_lorsa.training.distributed import DataParallel

    if mode == "hang":  # (for the launcher's test) rank 1 writes its pid and never ends; rank 0 then fails
        pid_file = out_prefix.removesuffix(str(rank)) + "1.pid"
        if rank == 1:
            with open(pid_file + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            time.sleep(600)
        while not os.path.exists(pid_file):
            time.sleep(0.05)
        raise SystemExit(3)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if mode == "grads":
            _reduced_grads(out_prefix)
            return
        for kind in KINDS:
            trainer = make_trainer(kind)
            DataParallel(trainer)
            trainer.train(progress=False)
            save_file(state(trainer), f"{out_prefix}_{kind}.safetensors")
        # a bf16 module: its fp32 masters broadcast from rank 0 (rank 1's start elsewhere) and stepped alike
        trainer = make_trainer("topk", torch.bfloat16)
        if rank == 1:
            with torch.no_grad():
                for m in trainer.masters.masters():
                    m.add_(1.0)
        DataParallel(trainer)
        trainer.train(progress=False)
        save_file(state(trainer), f"{out_prefix}_bf16.safetensors")
        # a NaN in one rank's shard: every rank stops at that step (none waits in a collective), state kept
        from nnsight_lorsa.errors import NonFiniteError

        trainer = make_trainer("topk")
        trainer.source = nan_on_rank_1
        DataParallel(trainer)
        try:
            trainer.train(progress=False)
        except NonFiniteError as e:
            save_file({**state(trainer), "failed_at": torch.tensor([e.step])}, f"{out_prefix}_nan.safetensors")
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path, world: int, mode: str, timeout: float = 120) -> None:
    """Runs :func:`_worker` in ``world`` gloo processes; rank ``r`` writes ``tmp_path / f"rank{r}_*"``
    (:func:`helpers.run_ranks`: no rank outlives the call)."""
    run_ranks(__file__, world, tmp_path, (mode,), timeout)


def test_two_gloo_processes_equal_one_process(tmp_path):
    from safetensors.torch import load_file

    from nnsight_lorsa.training.distributed import shard_batch

    _run_ranks(tmp_path, 2, "train")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: other thread counts round matmuls differently (TopK may flip)
    try:
        references = {}
        for kind in KINDS:
            single = make_trainer(kind)
            references[kind] = (single.train(progress=False), state(single))
    finally:
        torch.set_num_threads(threads)
    for kind in KINDS:
        ranks = [load_file(str(tmp_path / f"rank{r}_{kind}.safetensors")) for r in range(2)]
        history, want = references[kind]
        if kind == "topk":
            assert any(h["aux"] > 0 for h in history)  # AuxK took part
        assert not torch.equal(want["W_dec"], make_trainer(kind).module.W_dec)  # training moved the weights
        for name, value in want.items():
            for r in range(2):
                got = ranks[r][name]
                if value.dtype == torch.long:
                    assert torch.equal(got, value), (kind, name, r)
                else:
                    assert torch.allclose(got, value, atol=2e-6, rtol=1e-5), (kind, name, r,
                                                                             float((got - value).abs().max()))
    # bf16: both ranks hold the same masters and weights bit for bit (the weights the masters' rounding), close to
    # one process's bf16 run (the gradients are the average of the halves' rounded gradients, rounded once)
    ranks = [load_file(str(tmp_path / f"rank{r}_bf16.safetensors")) for r in range(2)]
    torch.set_num_threads(1)
    try:
        single = make_trainer("topk", torch.bfloat16)
        single.train(progress=False)
    finally:
        torch.set_num_threads(threads)
    want, start = state(single), state(make_trainer("topk", torch.bfloat16))
    masters = [n for n in want if n.startswith("master.")]
    assert len(masters) == len(list(single.module.parameters()))
    for name in want:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    for name in masters:
        got, weight = ranks[0][name], ranks[0][name.removeprefix("master.")]
        assert got.dtype == torch.float32 and torch.equal(weight, got.to(torch.bfloat16)), name
        update = float((want[name] - start[name]).norm())
        assert float((got - want[name]).norm()) < 0.05 * update, (name, float((got - want[name]).norm()), update)
    # NaN in rank 1's shard of batch NAN_STEP: both ranks raised NonFiniteError there, with the state of
    # NAN_STEP steps (one process, the same global batches)
    single = make_trainer("topk")
    torch.set_num_threads(1)
    try:
        single.train(NAN_STEP, progress=False)
    finally:
        torch.set_num_threads(threads)
    want = state(single)
    for r in range(2):
        got = load_file(str(tmp_path / f"rank{r}_nan.safetensors"))
        assert int(got.pop("failed_at")) == NAN_STEP, r
        for name, value in want.items():
            assert torch.allclose(got[name], value, atol=2e-6, rtol=1e-5), (name, r)
    # the shards of a batch are its contiguous halves
    b = global_batch(0)
    halves = [shard_batch(b, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h.x for h in halves]), b.x) and halves[0].x.shape[0] == 3
    from nnsight_lorsa.training.activations import Batch

    a = Batch(x=b.x, y=b.y, positions=torch.arange(9), loss_mask=b.loss_mask)
    half = shard_batch(a, 1, 2)
    assert torch.equal(half.positions, a.positions) and torch.equal(half.loss_mask, b.loss_mask[3:])


def test_ddp_averages_bf16_gradients_in_fp32_rounded_once(tmp_path):
    """3 ranks: a bf16 module's masters get the fp32 average of the ranks' bf16 gradients rounded once to bf16,
    where DDP's own bf16 path (each gradient divided by 3 in bf16, then summed in bf16) differs; an fp32 module
    has no comm hook (DDP's default path, as before)."""
    from safetensors.torch import load_file

    world = 3
    _run_ranks(tmp_path, world, "grads")
    bf16 = [load_file(str(tmp_path / f"rank{r}_bf16.safetensors")) for r in range(world)]
    names = [n.removeprefix("local.") for n in bf16[0] if n.startswith("local.")]
    assert len(names) == len(list(make_trainer("relu").module.parameters()))
    assert int(bf16[0]["hooks"]) == 1
    moved = total = 0
    for name in names:
        local = [bf16[r][f"local.{name}"] for r in range(world)]
        assert all(g.dtype == torch.bfloat16 for g in local)
        assert not torch.equal(local[0], local[1])  # the ranks' shards give different gradients
        want = (sum(g.float() for g in local) / world).to(torch.bfloat16).float()
        old = (local[0] / world).to(torch.bfloat16)  # DDP's own path: divided in bf16, a bf16 running sum
        for g in local[1:]:
            old = (old + g / world).to(torch.bfloat16)
        for r in range(world):
            got = bf16[r][f"reduced.{name}"]
            assert got.dtype == torch.float32 and torch.equal(got, want), (name, r, float((got - want).abs().max()))
        moved += int((old.float() != want).sum())
        total += want.numel()
    assert moved > 0.1 * total, (moved, total)  # the bf16 sum rounds differently: the test tells the two apart
    fp32 = [load_file(str(tmp_path / f"rank{r}_fp32.safetensors")) for r in range(world)]
    assert int(fp32[0]["hooks"]) == 0
    for name in names:
        want = sum(fp32[r][f"local.{name}"] for r in range(world)) / world
        for r in range(world):
            assert torch.allclose(fp32[r][f"reduced.{name}"], want, atol=1e-7, rtol=1e-5), (name, r)
    # the hook on a module of both dtypes: the bf16 bucket averaged in fp32 and rounded once, the fp32 bucket
    # reduced bit for bit as without the hook (torch's allreduce_hook, DDP's default)
    mixed = [load_file(str(tmp_path / f"rank{r}_mixed.safetensors")) for r in range(world)]
    want = (sum(m["local.low"].float() for m in mixed) / world).to(torch.bfloat16)
    for r in range(world):
        assert torch.equal(mixed[r]["True.low"], want), r
        assert not torch.equal(mixed[r]["False.low"], want), r  # DDP's bf16 path rounds elsewhere
        assert torch.equal(mixed[r]["True.high"], mixed[r]["False.high"]), r
        assert not torch.equal(mixed[r]["True.high"], mixed[r]["local.high"]), r  # reduced


def test_the_hook_in_a_one_process_group_keeps_each_gradient(tmp_path):
    """In this process (the package type-checked), :func:`_reduced_grads` on a one-rank gloo group: the average over
    one rank is the rank's own gradient (bf16 through the hook, widened onto the masters; fp32; both dtypes)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        _reduced_grads(str(tmp_path / "rank0"))
    finally:
        dist.destroy_process_group()
    for kind, hooks in (("bf16", 1), ("fp32", 0), ("mixed", None)):
        got = load_file(str(tmp_path / f"rank0_{kind}.safetensors"))
        assert hooks is None or int(got.pop("hooks")) == hooks
        for name in [n.removeprefix("local.") for n in got if n.startswith("local.")]:
            for reduced in ("reduced", "True", "False"):
                if f"{reduced}.{name}" in got:
                    assert torch.equal(got[f"{reduced}.{name}"], got[f"local.{name}"].float() if kind == "bf16"
                                       else got[f"local.{name}"]), (kind, reduced, name)


def test_a_failed_rank_ends_the_launch_and_no_rank_is_left_running(tmp_path):
    """:func:`_run_ranks` (the launcher of the tests above) kills the ranks still running once one has failed,
    instead of leaving them behind, each with its threads, after the test."""
    started = time.monotonic()
    with pytest.raises(AssertionError):
        _run_ranks(tmp_path, 2, "hang", timeout=60)
    assert time.monotonic() - started < 50  # rank 1 would sleep 600 s: it was killed, not waited for
    pid = int((tmp_path / "rank1.pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)


def test_live_source_shards_partition_the_global_batch():
    from helpers import tiny_training_setup

    from nnsight_lorsa.training import ActivationSource

    model, hf, adapter, data = tiny_training_setup()
    full = ActivationSource.transcoder(model, 1, data, batch_size=6, seed=2)
    parts = [full.shard(r, 2)(3) for r in range(2)]
    whole = full(3)
    assert parts[0].x.shape[0] == 3
    assert torch.allclose(torch.cat([p.x for p in parts]), whole.x, atol=1e-6)
    assert torch.allclose(torch.cat([p.y for p in parts]), whole.y, atol=1e-6)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    sys.stdout.flush()
    # gloo's background threads can abort the interpreter's own shutdown ("terminate called without an
    # active exception") after the results are written; leave without running C++ static destructors
    os._exit(0)
