"""Data-parallel training with ``torch.nn.parallel.DistributedDataParallel`` (any backend).

Every rank builds the same trainer (same module init, same source, same config), then::

    torch.distributed.init_process_group("gloo" | "nccl", ...)     # torchrun, or by hand
    DataParallel(trainer)                                          # wraps; attaches to trainer
    trainer.train()                                                # as in one process

Batch ``i`` of the source is the *global* batch. Each rank trains on its contiguous part of it
(``torch.tensor_split`` of the windows into ``world_size`` parts; sources with a ``shard(rank,
world)`` method — :class:`~.activations.ActivationSource`, live or cached — only compute / read
that part; a plain callable's batches are cut by :func:`shard_batch`, along dim 0, so a plain
callable yielding stacked CLT batches must shard itself). What makes the result equal to one process on the global batch
(tested on 2 CPU processes with gloo, parameters within ~1e-6):

* DDP all-reduces (averages) the gradients in the backward; each rank's loss is scaled by
  ``world · n_rank / n_global`` (tokens in the loss), so the average is the gradient of the
  global token mean even when ranks hold different numbers of tokens;
* the dead-latent counters see the global batch (:meth:`DataParallel.combine_firing`: fired
  masks OR-ed, token counts summed), and AuxK's normaliser ``E‖e‖²`` is the global mean
  (:meth:`DataParallel.global_mean`), so AuxK matches too;
* the dataset-norm factors are estimated on the global batches by every rank;
* a Lorsa's ``revive`` / ``resample`` remedies edit the dead heads from one batch: every rank takes rank 0's edit
  (:meth:`DataParallel.broadcast_edit`; computed from rank 0's shard, not the global batch);
* gradient clipping, Adam and the decoder renormalisation then run identically on every rank; a bf16
  module's fp32 master weights (:mod:`.master_weights`) are broadcast from rank 0 with its weights, and
  take the reduced gradients, widened to fp32.

Low-precision gradients are averaged in fp32. A module with bf16 / fp16 parameters gets a DDP communication hook
(:func:`fp32_mean_hook`): each such gradient bucket is widened to fp32, all-reduced (summed) in fp32, divided by the
world size in fp32 and rounded once back to the bucket's dtype, which DDP then copies into the gradients (whence
:meth:`~.master_weights.MasterWeights.move_grads` widens them onto the masters). DDP's own path sums the bf16
buckets in bf16 (after dividing each by the world size in bf16): every addition of the ring rounds to 8 significant
bits, so with 3+ ranks many entries of the average land a bf16 step or more off (37 % of a transcoder's on 3 ranks,
``tests/training/test_distributed.py``), where one rounding is what any bf16 gradient carries (one process's bf16
backward rounds its gradient too; on 2 ranks both paths round once). With or without masters
(``TrainConfig(master_weights=False)``: Adam on the bf16 weights, which then take the once-rounded average). Costs
an fp32 copy of one bucket at a time (DDP's buckets: 25 MiB of gradients by default, so 50 MiB of fp32 for bf16)
while it is reduced; the collective moves twice the bytes of a bf16 one. fp32 and fp64 buckets (and modules without
low-precision parameters: no hook at all) keep DDP's default path. Not chosen: writing the fp32 average straight
into the masters' ``.grad`` from the hook (saving the final rounding, at most half a bf16 step of the average, round
to nearest). It would depend on DDP's bucket layout (the offset and strides of each parameter's view in the flat
bucket), duplicate DDP's rule that a parameter no rank used keeps a ``None`` gradient (``find_unused_parameters``),
and give the masters a second source of gradients besides ``move_grads``, stale if a backward ever ran without the
step that consumes it.

Not identical: BatchTopK picks its ``k · n`` activations per rank (its batch is the shard), and
the logged metrics (FVU, L0, …) are rank-local. BatchTopK's inference threshold is one estimate on every rank:
each update's statistic (the smallest kept activation) is the mean of the ranks', weighted by their kept entries
(:meth:`DataParallel.combine_threshold`, inside :meth:`DataParallel.loss`); until 2026-11-27 each rank's threshold
followed its own shard and the ranks' saved thresholds differed. It approximates one process on the concatenated
batch (whose statistic is the smallest of the global top ``k · N``, between the ranks' smallest and largest).
Save checkpoints from one rank (all hold the same state). A rank-local error stops every rank: the failed rank
raises its own error, the others :class:`~..errors.RankFailedError` naming it and the step, and no rank waits in a
collective for a failed one. Its source raising is told with the step's first collective; an error in its forward pass
(the module, the objective, the loss) with one small all-reduce (:meth:`DataParallel._check`, ``world_size`` longs)
that every rank makes before each combining collective of the forward (the threshold's, the dead counters', AuxK's
mean: the failed rank's one more meets the others' next, whichever it is) and after the forward, before the backward's
gradient all-reduce (three to four per step for a BatchTopK SAE with AuxK; on 2 busy CPU cores with gloo a tiny
all-reduce took ~0.36 ms, +2.5 ms on a 12 ms toy step, nothing next to a real model's step); an error after the
forward pass (optimizer step, a remedy, logging, saving a checkpoint in :meth:`~.trainer.Trainer.train`) at the
others' next step's first collective, before a remedy's :meth:`DataParallel.broadcast_edit`, or at the end of
``train()`` (:meth:`DataParallel.finish`, one all-reduce per call). An error inside the backward pass (an autograd
hook or function raising on one rank) cannot be met (the others wait in DDP's gradient all-reduce): they stop when the
failed process exits or destroys its group, with :class:`~..errors.RankFailedError` naming it
(:meth:`DataParallel.backward_failed`: the failed rank records the step in the group's store; no cost per step; until
2026-11-28 gloo's raw "Connection closed by peer"); while it lives on, they wait until gloo's timeout. Devices: the
collectives run where the backend needs them (NCCL: the current CUDA device; gloo and others: the CPU), whatever
device the module and the combined tensors are on; results come back on the inputs' devices. Needs torch only (plus
the trainer's own imports).
"""

# (no ``from __future__ import annotations``: DDP checks a comm hook's annotations as objects, not strings)
import atexit
import gc
import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import NotReadyError, RankFailedError
from ..modules.activations import BatchTopK
from .activations import checked_batch
from .master_weights import LOW_PRECISION

#: the live :class:`DataParallel` wrappers, whose DDP modules :func:`_release_at_exit` drops
_LIVE: "weakref.WeakSet[DataParallel]" = weakref.WeakSet()


def _release_at_exit() -> None:
    """At interpreter exit (``atexit``, while the interpreter is whole): drop every live :class:`DataParallel`'s DDP
    module and collect it. A DDP module holds its process group; kept alive to the end (a trainer in a script's
    globals, or in a reference cycle) it was destroyed in the interpreter's finalization, after
    ``destroy_process_group``, and a rank whose run had ended in an error could abort there ("terminate called without
    an active exception", SIGABRT, no Python frame): 3 of 64 runs of the failure probe's ``[optimizer]`` case run as a
    plain script on 2 CPU processes, none of 140 with this (2026-11-29). Not a guarantee: run through the probe's
    pytest harness, 2 aborts in 96 runs with it; dropping the trainer before ``destroy_process_group`` is what
    docs/training.md advises. Registered with the first :class:`DataParallel`."""
    for dp in list(_LIVE):
        if hasattr(dp, "ddp"):
            del dp.ddp
    gc.collect()


class _LossModule(nn.Module):
    """``forward(batch) = trainer.loss(batch)``, with the trained module as a child (what DDP wraps)."""

    def __init__(self, trainer: Any) -> None:
        super(_LossModule, self).__init__()
        self.module = trainer.module
        self._loss = trainer.loss

    def forward(self, batch: Any) -> Any:
        return self._loss(batch)


def shard_batch(batch: Any, rank: int, world: int) -> Any:
    """A copy of a batch dataclass with every ``(batch, pos, …)`` tensor field (≥ 2 dims) cut to rank
    ``rank``'s part of dim 0 (``tensor_split`` into ``world`` parts); other fields (e.g. shared
    ``(pos,)`` positions) are kept. A field that is the same tensor as another (an SAE batch's
    ``y is x``) stays shared."""
    cut: dict[int, torch.Tensor] = {}
    fields = {}
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            if id(value) not in cut:
                cut[id(value)] = value.tensor_split(world)[rank]
            value = cut[id(value)]
        fields[name] = value
    return type(batch)(**fields)


def fp32_mean_hook(process_group: Any, bucket: dist.GradBucket):
    # (no return annotation: DDP accepts only ``torch.futures.Future[torch.Tensor]`` or none, and the futures that
    # collectives give are ``torch._C.Future``, not instances of it: a runtime type check would refuse them)
    """A DDP communication hook (``ddp.register_comm_hook(process_group, fp32_mean_hook)``): the average of a
    low-precision (:data:`~.master_weights.LOW_PRECISION`: bf16 / fp16) gradient bucket over the ranks of
    ``process_group`` (``None``: the global group), computed in fp32 and rounded once.

    The bucket's flat buffer (``(numel,)``, one dtype and device per bucket) is widened to an fp32 copy, all-reduced
    with ``SUM`` (async; any backend with futures: gloo on CPU, NCCL on CUDA), divided by the world size in fp32 and
    copied back into the buffer (the single rounding). Returns a ``torch.Future`` (``torch._C.Future``) that gives
    the buffer: the bucket's dtype, shape and device. Buckets of other dtypes (fp32, fp64) take DDP's default path,
    bit for bit: multiplied by ``1 / world`` in their dtype (as DDP's reducer scales a gradient into its bucket;
    torch's ``allreduce_hook`` divides instead, which rounds differently when the world size is not a power of 2),
    then summed in their dtype. A sum beyond fp32's range (bf16 values near 1.7e38 on two ranks) comes back ``inf``,
    which :meth:`~.trainer.Trainer.train_step` stops on (``NonFiniteError``).
    """
    buffer = bucket.buffer()
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if buffer.dtype not in LOW_PRECISION:
        buffer.mul_(1.0 / world)
        return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
    wide = buffer.to(torch.float32)

    def mean(fut: Any) -> torch.Tensor:  # (fut: a torch._C.Future of [the reduced fp32 copy])
        buffer.copy_(fut.value()[0].div_(world))
        return buffer

    return dist.all_reduce(wide, group=group, async_op=True).get_future().then(mean)



@contextmanager
def global_batch(reduce: Callable[[torch.Tensor, int], torch.Tensor | None]) -> Iterator[None]:
    """Inside, every :class:`~..modules.activations.BatchTopK` training update combines its statistic over the ranks
    of a data-parallel run.

    ``reduce(smallest, kept)`` is called on every rank at every update with this rank's smallest kept positive
    activation (a 0-d tensor in the estimate's dtype, fp32 at least; any value when ``kept == 0``) and the number of
    entries the batch rule kept on this rank (``k`` per row; ``0``: this rank kept no positive activation); it must
    return the same 0-d tensor on every rank (:meth:`DataParallel.combine_threshold`: the mean over the ranks with
    ``kept > 0``, weighted by ``kept``), or None on every rank when no rank had one (no update). Per process (the
    innermost ``global_batch`` holds; ranks are processes).
    """
    BatchTopK.global_batch.append(reduce)
    try:
        yield
    finally:
        BatchTopK.global_batch.pop()


class DataParallel:
    """Attach data-parallel training to a :class:`~.trainer.Trainer`.

    Args:
        trainer: built identically on every rank; its ``source`` yields global batches.
        process_group: default: the global group (``torch.distributed`` must be initialised).
        find_unused_parameters: passed to DDP (modules with parameters a loss may not reach).

    A module with bf16 / fp16 trained parameters has its gradients averaged in fp32 and rounded once
    (:func:`fp32_mean_hook`, registered on :attr:`ddp`); others reduce on DDP's default path. At interpreter exit
    (``atexit``) :attr:`ddp` is dropped and collected, before the interpreter's finalization, whether or not the
    trainer is still alive (:func:`_release_at_exit`: fewer aborts at exit after an error; docs/training.md).

    Raises:
        NotReadyError: (a ``RuntimeError``) ``torch.distributed`` is not initialised.

    Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
    """

    def __init__(self, trainer: Any, process_group: Any = None, find_unused_parameters: bool = False) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise NotReadyError("DataParallel(trainer): torch.distributed is not initialised: call "
                                "torch.distributed.init_process_group(...) first (torchrun sets its environment)")
        self.group = process_group
        #: where the collectives' tensors go: NCCL reduces CUDA tensors only, gloo (and the rest) CPU ones
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend(process_group) == "nccl" else torch.device("cpu"))
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.trainer = trainer
        source = trainer.source
        shard = getattr(source, "shard", None)
        if callable(shard):
            self.source = shard(self.rank, self.world_size)
        else:  # a plain callable: compute the global batch, keep this rank's part
            rank, world = self.rank, self.world_size
            self.source = lambda index: shard_batch(checked_batch(source(index), index), rank, world)
        # DDP broadcasts rank 0's parameters and buffers now; buffers (BatchTopK thresholds) are
        # not re-broadcast at every forward
        # (torch 2.13 deprecates broadcast_buffers for forward_sync_buffers)
        new_api = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_forward_sync: dict[str, Any] = {"forward_sync_buffers": False} if new_api else {"broadcast_buffers": False}
        self.ddp = DistributedDataParallel(
            _LossModule(trainer), process_group=process_group, find_unused_parameters=find_unused_parameters,
            **no_forward_sync)
        if not _LIVE:
            atexit.unregister(_release_at_exit)  # (registered once)
            atexit.register(_release_at_exit)
        _LIVE.add(self)
        if any(p.dtype in LOW_PRECISION for p in trainer.module.parameters() if p.requires_grad):
            # bf16 / fp16 gradients averaged in fp32, rounded once (module docstring); else DDP's own path
            self.ddp.register_comm_hook(process_group, fp32_mean_hook)
        # a bf16 module's fp32 masters follow rank 0's too (DDP has just broadcast its bf16 weights): every
        # rank then steps the same masters with the same reduced gradients
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self._src = src
        for m in [*trainer.masters.masters(), *trainer.masters.buffer_masters()]:  # (BatchTopK's θ: its master)
            buf = m.detach().to(self.device)
            dist.broadcast(buf, src=src, group=process_group)
            with torch.no_grad():
                m.copy_(buf)
        trainer.masters.round_()
        trainer.masters.round_buffers_()
        #: the step whose forward is under way (None outside one): the combining collectives check the ranks first
        self._forward_step: int | None = None
        trainer.dist = self

    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """``t`` reduced over the ranks, on ``t``'s device (reduced on :attr:`device`)."""
        buf = t.to(self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op is None else op, group=self.group)
        return buf.to(t.device)

    def _check(self, failed: bool = False) -> list[int]:
        """The ranks that failed in the forward of step :attr:`_forward_step` (this rank: ``failed``), told to every
        rank with one ``(world_size,)`` all-reduce. Every rank makes one of these before each combining collective
        of the forward and one after it; a rank whose forward raised makes just one more, which meets the others'
        next (whatever collective of the forward they were about to enter), so no rank waits for a failed one.

        Raises:
            RankFailedError: another rank failed (when this one did not).
        """
        flags = torch.zeros(self.world_size, dtype=torch.long, device=self.device)
        flags[self.rank] = failed
        failed_ranks = [r for r, f in enumerate(self._all_reduce(flags).tolist()) if f]
        if failed_ranks and not failed:
            step, self._forward_step = self._forward_step, None  # told: the forward's except does not tell again
            raise self._rank_failed(step, failed_ranks, "in the forward pass (its loss)")
        return failed_ranks

    def _rank_failed(self, step: int | None, ranks: list[int], where: str) -> RankFailedError:
        """The :class:`RankFailedError` of this rank when ``ranks`` failed at ``step`` ``where``."""
        return RankFailedError(f"step {step}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of "
                               f"the data-parallel run failed {where} (see its own error); this rank stopped at the "
                               "same step", step=-1 if step is None else step, ranks=ranks)

    def _between(self, n_local: int = 0, failed: tuple[int, bool] | None = None, own: bool = False) -> int:
        """The collective the ranks make between two steps' work (the first of :meth:`loss`, the one before
        :meth:`broadcast_edit`, :meth:`finish`, :meth:`tell_failed`): ``(1 + world_size,)`` longs, ``Σ_ranks
        n_local`` and, per rank, ``1 + 2·step + after`` where it failed (``failed = (step, after)``: ``after`` False
        getting its batch, True after its forward pass), else 0. Returns ``Σ_ranks n_local``.

        Raises:
            RankFailedError: another rank failed (unless ``own``: this rank raises its own error).
        """
        flags = torch.zeros(1 + self.world_size, dtype=torch.long, device=self.device)
        flags[0] = n_local
        if failed is not None:
            flags[1 + self.rank] = 1 + 2 * failed[0] + failed[1]
        counts: list[int] = self._all_reduce(flags).tolist()
        told = {r: divmod(v - 1, 2) for r, v in enumerate(counts[1:]) if v}
        if told and not own:
            step, after = told[min(told)]
            raise self._rank_failed(step, sorted(told), "after its forward pass (in its optimizer step, a dead-latent "
                                    "remedy, logging or saving a checkpoint)" if after else
                                    "getting its part of the batch")
        return int(counts[0])

    def _store(self) -> Any:
        """The group's key-value store (the one ``init_process_group`` made; reached through torch's private
        ``distributed_c10d._get_process_group_store``), or None where this torch has no such function."""
        try:
            from torch.distributed import distributed_c10d as c10d

            group = self.group if self.group is not None else c10d._get_default_group()
            return c10d._get_process_group_store(group)
        except Exception:  # noqa: BLE001 (a private function: without it, the raw error stays)
            return None

    def backward_failed(self, step: int) -> RankFailedError | None:
        """Called by :meth:`~.trainer.Trainer.train_step` on every rank whose backward pass of step ``step``
        raised. A rank whose own backward raised (an autograd hook or function) cannot meet the others' gradient
        all-reduce: they wait in it until that process closes its connections (it exits or destroys its group), then
        gloo raises its raw ``RuntimeError`` ("Connection closed by peer") in their backward. So the failed rank
        records ``step`` in the group's store (one key, only on failure: no cost per step) and its own error goes on;
        a rank whose backward raised while another's key of the step is there returns the
        :class:`RankFailedError` naming those ranks (the caller raises it from the raw error). Returns None (the
        caller re-raises its error) for this rank's own failure, or where the store cannot be reached.

        Not bounded by this: while the failed process lives on (its error caught, the group kept), the others wait
        in the all-reduce (gloo's timeout, 30 minutes by default).

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        store = self._store()
        if store is None:
            return None
        try:
            others = [r for r in range(self.world_size)
                      if r != self.rank and store.check([f"nnsight_lorsa/backward_failed/{r}/{step}"])]
            if not others:
                store.set(f"nnsight_lorsa/backward_failed/{self.rank}/{step}", str(step))
                return None
        except Exception:  # noqa: BLE001 (the store is gone too: the raw error stays)
            return None
        return self._rank_failed(step, others, "in its backward pass (an autograd hook or function raised)")

    def tell_failed(self, step: int) -> None:
        """Tell the other ranks that this rank failed after its forward pass of step ``step`` (its own error is then
        raised by the caller, :class:`~.trainer.Trainer`): they raise :class:`RankFailedError` at their next step's
        first collective, before a remedy's :meth:`broadcast_edit` or at the end of :meth:`~.trainer.Trainer.train`
        (:meth:`finish`), whichever they reach first.

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        self._between(0, (step, True), own=True)

    def finish(self) -> None:
        """The end of a :meth:`~.trainer.Trainer.train` call on every rank: a rank that failed after its last forward
        pass is heard here (:meth:`tell_failed`). One small all-reduce per call.

        Raises:
            RankFailedError: another rank failed after its forward pass.

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        self._between()

    def _checked(self) -> None:
        """:meth:`_check` when inside a forward (the combining collectives' first step)."""
        if self._forward_step is not None:
            self._check()

    def _count(self, n: int) -> int:
        """``Σ_ranks n``."""
        return int(self._all_reduce(torch.tensor([n], dtype=torch.long, device=self.device)))

    def combine_firing(self, fired: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, int]:
        """``(fired on any rank, tokens on all ranks)`` for the dead-latent counters.

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        self._checked()
        f = self._all_reduce(fired.to(torch.int32), dist.ReduceOp.MAX)
        return f.bool(), self._count(n_tokens)

    def combine_counts(self, counts: torch.Tensor, z_max: torch.Tensor, n_tokens: int
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(Σ_ranks counts, max_ranks z_max, Σ_ranks n_tokens)`` for per-latent firing statistics.

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        self._checked()
        c = self._all_reduce(counts.to(torch.float64))
        z = self._all_reduce(z_max.detach().clone(), dist.ReduceOp.MAX)
        return c, z, self._count(n_tokens)

    def global_mean(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """``Σ_ranks total / Σ_ranks count`` (no gradient): a mean over the global batch.

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        self._checked()
        t = torch.stack([total.detach().to(torch.float64).reshape(()),
                         torch.tensor(float(count), dtype=torch.float64, device=total.device)])
        t = self._all_reduce(t)
        return (t[0] / t[1]).to(total.dtype)

    def combine_threshold(self, smallest: torch.Tensor, kept: int) -> torch.Tensor | None:
        """The statistic of a :class:`~..modules.activations.BatchTopK` threshold update over the ranks
        (:func:`~..modules.activations.global_batch`): the mean of the ranks' smallest kept positive activations
        ``smallest`` (0-d), weighted by their kept entries ``kept`` (0: none positive on this rank; its value is not
        used), computed in fp64 and returned in ``smallest``'s dtype and device — the same on every rank; None on
        every rank when no rank had one.

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        self._checked()
        t = torch.stack([smallest.detach().to(torch.float64).reshape(()) * kept,
                         torch.tensor(float(kept), dtype=torch.float64, device=smallest.device)])
        t = self._all_reduce(t)
        if not bool(t[1] > 0):
            return None
        return (t[0] / t[1]).to(smallest.dtype)

    @torch.no_grad()
    def broadcast_edit(self, tensors: tuple[torch.Tensor, ...], moved: torch.Tensor, n: int) -> torch.Tensor:
        """Rank 0's values of ``tensors`` (written in place on every rank) and its ``moved`` indices (1-D, into
        ``[0, n)``), returned on every rank: the edit of a remedy computed from one rank's shard (a Lorsa's
        ``revive`` / ``resample``), made the same on every rank (until 2026-11-27 each rank kept its own edit and the
        ranks' weights parted).

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        self._between()  # a rank that failed in its optimizer step tells here (tell_failed), not in the broadcast
        mask = torch.zeros(n, dtype=torch.int32, device=self.device)
        mask[moved.to(self.device)] = 1
        dist.broadcast(mask, src=self._src, group=self.group)
        for t in tensors:
            buf = t.detach().to(self.device)
            dist.broadcast(buf, src=self._src, group=self.group)
            t.copy_(buf)
        return mask.nonzero().flatten().to(moved.device)

    def all_finite(self, finite: torch.Tensor) -> torch.Tensor:
        """A bool scalar: ``finite`` (this rank's bool scalar) is True on every rank — so that a
        non-finite loss or gradient stops every rank at the same step (:meth:`~.trainer.Trainer.train_step`).

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        return self._all_reduce(finite.to(torch.int32).reshape(1), dist.ReduceOp.MIN).bool()[0]

    def loss(self, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """This rank's loss on its part of global batch ``step``, through DDP, scaled so that the
        averaged gradient is the global batch's.

        Raises:
            RankFailedError: another rank's source or forward pass raised at this step (this rank's raising: its own
                error, after the other ranks were told; no rank waits in a collective for a failed one).

        Source: ours (on ``torch.nn.parallel.DistributedDataParallel``).
        """
        failure: BaseException | None = None
        try:  # a rank-local error: told to the other ranks with the step's first collective (none waits in one)
            batch = self.source(step)
            mask = getattr(batch, "loss_mask", None)
            n_local = int(mask.sum()) if mask is not None else int(next(iter(vars(batch).values())).shape[0])
        except Exception as e:  # noqa: BLE001 (re-raised below, after the others know)
            failure, n_local = e, 0
        n_global = self._between(n_local, None if failure is None else (step, False), own=failure is not None)
        if failure is not None:
            raise failure
        # an error in the forward (the objective, the module, the loss) is told with one small all-reduce after it
        # (:meth:`_check`, also made before each combining collective of the forward), before the backward's
        self._forward_step = step
        try:
            with global_batch(self.combine_threshold):  # BatchTopK thresholds: one estimate on every rank
                loss, metrics = self.ddp(batch)
        except Exception:
            if self._forward_step is not None:  # this rank's own error (not another's, told by _check): tell them
                self._check(failed=True)
            raise
        else:
            self._check()
        finally:
            self._forward_step = None
        return loss * (n_local * self.world_size / max(1, n_global)), metrics
