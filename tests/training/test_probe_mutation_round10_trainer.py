"""Mutation probe, round 10 (docs/reliability.md): the trainer's loop, logging and checkpoints
(``training/trainer.py``) and data parallelism's rank arithmetic (``training/distributed.py``), each test seen failing
with the mutant it names and passing without.

The data-parallel tests play one rank of two in this process: a :class:`DataParallel` built without a process group
(``object.__new__``) whose ``_all_reduce`` adds what the other rank would contribute (the ``flags`` that rank sends
are recorded from the same code playing it), or one built where ``torch.distributed`` (as it reads it) says rank 1
of 2; no process group is made and no second process starts.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from nnsight_lorsa.errors import ArgumentError, RankFailedError
from nnsight_lorsa.training.activations import Batch
from nnsight_lorsa.training.distributed import DataParallel

D = 8


# ------------------------------------------------------------------ data parallel, one rank of two played here
def _rank(rank: int, world: int = 2, peer: torch.Tensor | None = None, sent: list | None = None) -> DataParallel:
    """A :class:`DataParallel` of ``rank`` in ``world`` with no process group: its all-reduce records what it sends
    (``sent``) and returns it reduced with ``peer`` (the other ranks' contribution; none: its own) by its op (sum,
    min, max)."""
    import torch.distributed as dist

    dp = object.__new__(DataParallel)
    dp.rank, dp.world_size, dp.device, dp.group, dp._forward_step = rank, world, torch.device("cpu"), None, None

    def all_reduce(t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if sent is not None:
            sent.append(t.clone())
        if peer is None:
            return t.clone()
        other = peer.to(t.dtype)
        if op == dist.ReduceOp.MIN:
            return torch.minimum(t, other)
        if op == dist.ReduceOp.MAX:
            return torch.maximum(t, other)
        return t + other

    dp._all_reduce = all_reduce  # type: ignore[method-assign]
    return dp


def test_the_threshold_statistic_is_the_mean_weighted_by_each_ranks_kept_entries():
    """combine_threshold: Σ kept_r · smallest_r / Σ kept_r (its docstring); rank 0 smallest 1.0 over 3 kept entries,
    rank 1 smallest 2.0 over 1: 1.25 (the unweighted mean would be 1.5); no rank with a kept entry: None."""
    peer = torch.tensor([2.0 * 1, 1.0], dtype=torch.float64)  # rank 1's (smallest · kept, kept)
    got = _rank(0, peer=peer).combine_threshold(torch.tensor(1.0), 3)
    assert got is not None and got.dtype == torch.float32
    assert float(got) == pytest.approx((1.0 * 3 + 2.0 * 1) / (3 + 1), rel=1e-12)
    none = _rank(0, peer=torch.zeros(2, dtype=torch.float64)).combine_threshold(torch.tensor(7.0), 0)
    assert none is None


def test_the_ranks_averaged_losses_are_the_global_batchs_token_mean():
    """DataParallel.loss scales each rank's token-mean loss so that DDP's average over the ranks is the mean over
    every counted token of the global batch (the module docstring), here with 9 and 5 counted tokens: the average of
    the two ranks' returned losses equals plain torch's mean over the global mask."""
    g = torch.Generator().manual_seed(3)
    values = torch.rand(6, 4, generator=g)
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[:, 0] = False
    mask[4:, 2:] = False  # rank 1's rows partly padding: 9 and 5 counted tokens
    n_global = int(mask.sum())
    losses = []
    for rank in range(2):
        dp = _rank(rank)
        rows = slice(3 * rank, 3 * rank + 3)
        dp.source = lambda step, rows=rows: Batch(x=values[rows, :, None], y=values[rows, :, None],
                                                  loss_mask=mask[rows])
        dp.ddp = lambda batch: (batch.x[..., 0][batch.loss_mask].mean(), {})
        dp._between = lambda n_local, failed=None, own=False: n_global  # Σ_ranks n_local
        dp._check = lambda failed=False: []
        losses.append(dp.loss(0)[0])
    assert float(sum(losses) / 2) == pytest.approx(float(values[mask].mean()), rel=1e-6)


@pytest.mark.parametrize(("mine", "theirs"), [(True, False), (False, True), (False, False)])
def test_a_step_goes_on_only_when_every_ranks_loss_and_gradient_are_finite(mine, theirs):
    """all_finite: True on every rank only where it is True on every rank (one rank's non-finite loss stops all);
    both True: True."""
    got = _rank(0, peer=torch.tensor([int(theirs)])).all_finite(torch.tensor(mine))
    assert got.dtype == torch.bool and not bool(got)
    assert bool(_rank(0, peer=torch.tensor([1])).all_finite(torch.tensor(True)))


@pytest.mark.parametrize(("step", "after", "where"), [(0, False, "getting its part of the batch"),
                                                      (3, False, "getting its part of the batch"),
                                                      (0, True, "after its forward pass"),
                                                      (5, True, "after its forward pass")])
def test_a_failure_told_between_steps_reaches_the_other_rank_with_its_step_and_kind(step, after, where):
    """Round trip of _between's flags: what rank 1 sends when it fails (tell_failed's, or the source's) is what rank 0
    adds at its own next collective; rank 0 then raises RankFailedError naming rank 1, that step and where it failed
    — also at step 0 and for a failure getting the batch (a flag 0 reads as "no failure")."""
    sent: list[torch.Tensor] = []
    assert _rank(1, sent=sent)._between(4, (step, after), own=True) == 4
    with pytest.raises(RankFailedError) as info:
        _rank(0, peer=sent[0])._between(5)
    assert info.value.ranks == [1] and info.value.step == step
    assert f"step {step}: rank 1 " in str(info.value) and where in str(info.value)
    # no failure: the token counts add up and nothing is raised
    sent.clear()
    _rank(1, sent=sent)._between(4)
    assert _rank(0, peer=sent[0])._between(5) == 9


@pytest.fixture
def as_rank_1_of_2(monkeypatch):
    """DataParallel's view of a group in which this process is rank 1 of 2 (gloo): torch.distributed as it reads it,
    with DDP's wrapper a stand-in (no process group is made; fp32 modules: no master to broadcast)."""
    import torch.distributed as dist

    from nnsight_lorsa.training import distributed as module

    seen = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if not n.startswith("__")})
    seen.is_available = seen.is_initialized = lambda: True
    seen.get_backend = lambda group=None: "gloo"
    seen.get_rank = lambda group=None: 1
    seen.get_world_size = lambda group=None: 2
    monkeypatch.setattr(module, "dist", seen)
    seen.broadcast = lambda tensor, src=0, group=None: tensor.fill_(0.5)  # rank 0's values: 0.5 everywhere
    monkeypatch.setattr(module, "DistributedDataParallel",
                        lambda loss_module, **kwargs: types.SimpleNamespace(module=loss_module,
                                                                            register_comm_hook=lambda *a: None))


def _sae_trainer(source: Any, activation: str = "topk", dtype: torch.dtype = torch.float32) -> Any:
    from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
    from nnsight_lorsa.training import TrainConfig, Trainer

    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=D, d_sae=16, activation=activation, activation_params={"k": 2}))
    return Trainer(sae.to(dtype), source, TrainConfig(total_steps=4, lr=1e-3, norm_batches=1))


def _global(index: int) -> Batch:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(5, 4, D, generator=g)
    return Batch(x=x, y=x, loss_mask=torch.ones(5, 4, dtype=torch.bool), positions=torch.arange(4))


def test_rank_1_of_2_trains_on_the_second_part_of_each_global_batch(as_rank_1_of_2):
    """Rank 1 of 2: a plain callable's batch cut to its second part along dim 0 (rows 3: of 5, torch.tensor_split's
    rule), the shared ``(pos,)`` positions kept whole and ``y is x`` kept shared; a source with a ``shard`` method is
    asked for ``shard(1, 2)``."""
    dp = DataParallel(_sae_trainer(_global))
    got, whole = dp.source(2), _global(2)
    assert torch.equal(got.x, whole.x[3:]) and got.y is got.x
    assert torch.equal(got.loss_mask, whole.loss_mask[3:]) and torch.equal(got.positions, torch.arange(4))

    class Sharded:
        def __init__(self) -> None:
            self.asked: list[tuple[int, int]] = []

        def __call__(self, index: int) -> Batch:
            return _global(index)

        def shard(self, rank: int, world: int) -> Any:
            self.asked.append((rank, world))
            return lambda index: Batch(x=_global(index).x[rank::world], y=_global(index).x[rank::world],
                                       loss_mask=torch.ones(len(range(rank, 5, world)), 4, dtype=torch.bool))

    sharded = Sharded()
    DataParallel(_sae_trainer(sharded))
    assert sharded.asked == [(1, 2)]


# ------------------------------------------------------------------ the training loop
def _source(index: int) -> Batch:
    g = torch.Generator().manual_seed(100 + index)
    x = torch.randn(3, 5, D, generator=g)
    return Batch(x=x, y=x, loss_mask=torch.ones(3, 5, dtype=torch.bool))


def _trainer(**config: Any) -> Any:
    from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
    from nnsight_lorsa.training import TrainConfig, Trainer

    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=D, d_sae=16, activation="topk", activation_params={"k": 2}))
    return Trainer(sae, _source, TrainConfig(**{"total_steps": 5, "lr": 1e-3, "norm_batches": 1, **config}))


def test_train_takes_that_many_more_steps_logs_on_its_cadence_and_checkpoints_on_its_own(tmp_path):
    """train(steps): ``steps`` more steps, never past total_steps; a history entry (with its step) every log_every
    steps and at the last step of each call; a checkpoint whenever the step count is a multiple of checkpoint_every
    and at the end of the call (train's docstring; the end since 2026-11-29, as the sparse-attention trainer)."""
    from nnsight_lorsa.training import Trainer

    trainer, seen = _trainer(log_every=2), []
    trainer.train(1, progress=False, on_log=lambda m: seen.append(m["step"]))
    assert trainer.step == 1
    trainer.train(2, progress=False, on_log=lambda m: seen.append(m["step"]))
    assert trainer.step == 3
    saved, save = [], trainer.save_checkpoint
    trainer.save_checkpoint = lambda d: (saved.append(trainer.step), save(d))  # type: ignore[method-assign]
    trainer.train(progress=False, on_log=lambda m: seen.append(m["step"]), checkpoint_dir=tmp_path / "ck",
                  checkpoint_every=2)
    assert trainer.step == 5
    assert seen == [1, 2, 3, 4, 5] and [m["step"] for m in trainer.history] == seen
    assert saved == [4, 5]  # after step 4 (not 3), and at the end
    assert Trainer.load_checkpoint(tmp_path / "ck")[0]["step"] == 5
    with pytest.raises(ArgumentError, match="at its end"):  # total_steps reached: refused (a silent no-op until
        trainer.train(5, progress=False)  # 2026-11-30: tests/training/test_probe_day_one.py)
    trainer.train(progress=False)  # to total_steps: nothing more to do, quietly
    assert trainer.step == 5


def test_an_infinite_activation_is_refused_before_it_makes_a_zero_scale_factor():
    """An inf in the norm batches makes E‖x‖ inf and s = sqrt(d) / E‖x‖ exactly 0.0 (finite): a scale factor must be a
    finite *positive* number (estimate_norms' docstring), so the first step raises NonFiniteError and leaves the
    scale factors unset."""
    from nnsight_lorsa.errors import NonFiniteError

    def source(index: int) -> Batch:
        b = _source(index)
        b.x[0, 1, 2] = float("inf")
        return b

    trainer = _trainer()
    trainer.source = source
    assert torch.sqrt(torch.tensor(float(D))) / source(0).x.norm(dim=-1).mean() == 0  # the factor it would make
    with pytest.raises(NonFiniteError, match="s_in"):
        trainer.train_step()
    assert trainer.s_in is None and trainer.s_out is None and trainer.step == 0


def test_every_rank_takes_rank_0s_fp32_masters_the_batchtopk_thresholds_included(as_rank_1_of_2):
    """A bf16 BatchTopK SAE: DataParallel broadcasts rank 0's fp32 masters (here 0.5 everywhere), the inference
    threshold's master among them, and the module's weights and threshold become their bf16 rounding (the module
    docstring: "every rank then steps the same masters")."""
    trainer = _sae_trainer(_global, "batchtopk", torch.bfloat16)
    buffers = list(trainer.masters.buffer_masters())
    assert buffers and len(trainer.masters) == len(list(trainer.module.parameters()))
    DataParallel(trainer)
    for m in [*trainer.masters.masters(), *buffers]:
        assert m.dtype == torch.float32 and bool((m == 0.5).all())
    for name, t in [*trainer.module.named_parameters(), *trainer.module.named_buffers()]:
        if t.is_floating_point():
            assert bool((t == 0.5).all()), name


class _OneRank:
    """A stand-in for :attr:`Trainer.dist` (one rank: its collectives are identities) whose loss is ``make(step)``;
    records the steps told to the other ranks."""

    rank = 0

    def __init__(self, make: Any) -> None:
        self.make, self.told = make, []

    def loss(self, step: int) -> Any:
        return self.make(step)

    def all_finite(self, finite: torch.Tensor) -> torch.Tensor:
        return finite

    def tell_failed(self, step: int) -> None:
        self.told.append(step)


def test_under_data_parallelism_a_non_finite_loss_with_a_finite_gradient_stops_the_step():
    """train_step under a DataParallel: the loss is rank-local, so its finiteness goes into the all-ranks check with
    the gradient's (a NaN loss term that carries no gradient still stops every rank, the weights untouched)."""
    from nnsight_lorsa.errors import NonFiniteError

    trainer = _trainer()
    trainer.estimate_norms()
    w = trainer.module.W_dec

    def make(step: int) -> Any:
        loss = w.square().sum() + torch.tensor(float("nan"))  # gradient 2·W_dec, finite; value NaN
        return loss, {"loss": float(loss.detach())}

    trainer.dist = _OneRank(make)
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    with pytest.raises(NonFiniteError, match="loss"):
        trainer.train_step()
    assert trainer.step == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.module.named_parameters())


def test_an_error_after_the_forward_is_told_to_the_other_ranks_but_another_ranks_failure_is_not():
    """Trainer._told: this rank's own error after its forward pass is told (tell_failed with the step), then
    re-raised; a RankFailedError (another rank's failure, already known to all) passes through untold."""
    trainer = _trainer()
    trainer.dist = _OneRank(None)
    trainer.step = 3
    with pytest.raises(ValueError, match="own"), trainer._told():
        raise ValueError("own")
    assert trainer.dist.told == [3]
    with pytest.raises(RankFailedError), trainer._told():
        raise RankFailedError("peer", step=3, ranks=[1])
    assert trainer.dist.told == [3]


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize(("s_in", "s_out"), [(None, None), (0.0, 1.5), (1.5, 0)])
def test_a_checkpoint_past_step_0_without_positive_scale_factors_is_refused(tmp_path, s_in, s_out):
    """trainer.json's s_in / s_out are positive finite numbers, or both null before the first step only
    (_check_progress): a null pair at step 1 would make the resumed run estimate the factors again (a run no
    uninterrupted one gives), a 0 factor would zero the module's inputs or outputs."""
    import json

    from test_probe_checkpoint_files import remanifest

    from nnsight_lorsa.errors import CheckpointError
    from nnsight_lorsa.training import Trainer

    trainer = _trainer()
    trainer.train(1, progress=False)
    trainer.save_checkpoint(tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "trainer.json").read_text())
    assert meta["step"] == 1 and meta["s_in"] > 0 and meta["s_out"] > 0
    meta["s_in"], meta["s_out"] = s_in, s_out
    (tmp_path / "ck" / "trainer.json").write_text(json.dumps(meta))
    remanifest(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="trainer.json: key 's_(in|out)' must be a positive finite number"):
        Trainer.resume(tmp_path / "ck", _source)


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_of_a_data_parallel_run_logs_to_wandb(monkeypatch, rank):
    """With wandb_project set, the W&B run is started on rank 0 only (_wandb_run's docstring): the other ranks log
    nothing (one run per training run, not one per rank)."""
    from nnsight_lorsa.training import trainer as module

    started: list[str] = []

    class Run(module.WandbRun):  # (the return type is checked at run time)
        id = "run-id"

        def __init__(self, project: str, *args: Any) -> None:
            started.append(project)

        def log(self, *args: Any, **kwargs: Any) -> None:
            pass

    monkeypatch.setattr(module, "WandbRun", Run)
    trainer = _trainer(wandb_project="probe")
    trainer.dist = types.SimpleNamespace(rank=rank)
    got = trainer.log_evaluation({"fvu": 0.5})
    assert got == {"eval/fvu": 0.5}
    assert started == (["probe"] if rank == 0 else [])


def test_after_close_logging_the_next_log_goes_to_a_new_handle_of_the_same_run(monkeypatch):
    """close_logging finishes the W&B run; a later log_evaluation continues the same run (its id) through a new
    handle, not the finished one."""
    from nnsight_lorsa.training import trainer as module

    runs: list[Any] = []

    class Run(module.WandbRun):  # (the return type is checked at run time)
        def __init__(self, project: str, name: Any, config: Any, run_id: Any) -> None:
            self.id, self.finished, self.logged = run_id or "run-id", False, []
            runs.append(self)

        def log(self, metrics: Any, step: int) -> None:
            assert not self.finished, "logged to a finished run"
            self.logged.append(metrics)

        def finish(self) -> None:
            self.finished = True

    monkeypatch.setattr(module, "WandbRun", Run)
    trainer = _trainer(wandb_project="probe")
    trainer.log_evaluation({"fvu": 0.5})
    trainer.close_logging()
    trainer.log_evaluation({"fvu": 0.25})
    assert [r.finished for r in runs] == [True, False] and runs[1].id == runs[0].id == trainer.wandb_run_id
    assert runs[1].logged == [{"eval/fvu": 0.25}]


def test_a_resumed_trainer_keeps_the_history_it_was_saved_with(tmp_path):
    """The history (every logged entry) is part of a checkpoint: a resumed trainer's history is the saved
    one, and a resumed train() appends to it."""
    from nnsight_lorsa.training import Trainer

    trainer = _trainer(log_every=1)
    trainer.train(2, progress=False)
    trainer.save_checkpoint(tmp_path / "ck")
    resumed = Trainer.resume(tmp_path / "ck", _source)
    assert resumed.history == trainer.history and [m["step"] for m in resumed.history] == [1, 2]
    resumed.train(1, progress=False)
    assert [m["step"] for m in resumed.history] == [1, 2, 3]


def test_trainers_sharing_one_config_keep_their_own_history(tmp_path):
    """One ``TrainConfig`` for several runs (a loop over layers, a sweep): each trainer's history is its own, and the
    config is unchanged by a run. Until 2026-11-29 the history was the config's field: the second run returned and
    checkpointed both runs' entries (steps 1 … 4, 1 … 4), a training-curve plot of it mixed two runs."""
    import dataclasses
    import json

    from nnsight_lorsa.errors import CheckpointError
    from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
    from nnsight_lorsa.training import TrainConfig, Trainer

    config = TrainConfig(total_steps=4, lr=1e-3, norm_batches=1, log_every=1)
    before = dataclasses.asdict(config)
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        sae = SparseAutoencoder(SAEConfig(d_in=D, d_sae=16, activation="topk", activation_params={"k": 2}))
        trainer = Trainer(sae, _source, config)
        assert trainer.train(progress=False) is trainer.history
        runs.append(trainer)
    assert [[m["step"] for m in t.history] for t in runs] == [[1, 2, 3, 4]] * 2
    assert runs[0].history != runs[1].history  # two modules, two runs
    assert dataclasses.asdict(config) == before
    runs[1].save_checkpoint(tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "trainer.json").read_text())
    assert [m["step"] for m in meta["history"]] == [1, 2, 3, 4] and "history" not in meta["train_config"]
    # restore_state sets the history too; a history that is not a list of objects is the checkpoint's error
    fresh = Trainer(SparseAutoencoder(SAEConfig(d_in=D, d_sae=16, activation="topk", activation_params={"k": 2})),
                    _source, config)
    fresh.restore_state(tmp_path / "ck", meta)
    assert fresh.history == runs[1].history and fresh.step == 4
    for bad in ("steps", [1, 2], {"step": 1}):
        with pytest.raises(CheckpointError, match="key 'history' must be a list of objects"):
            fresh.restore_state(tmp_path / "ck", {**meta, "history": bad})
    assert fresh.history == runs[1].history  # a refused restore changed nothing
