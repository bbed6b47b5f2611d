"""Activation functions of sparse dictionaries (SAEs, transcoders, CLTs) as small ``nn.Module`` s.

Each maps pre-activations ``(*batch, d_sae)`` to sparse feature activations of the same shape (zeros
where a feature is off; non-negative except :class:`AbsTopK`):

* :class:`ReLU` — ``max(0, x)``; sparsity comes from an L1 penalty in training (Bricken et al. 2023, *Towards
  Monosemanticity*).
* :class:`TopK` — keep the ``k`` largest pre-activations per row, ReLU'd (Makhzani & Frey 2013;
  Gao et al. 2024, *Scaling and evaluating sparse autoencoders*; EleutherAI sparsify).
* :class:`BatchTopK` — in training keep the ``k · n_rows`` largest activations over the whole
  batch; at inference a threshold estimated in training (Bussmann et al. 2024, *BatchTopK Sparse
  Autoencoders*, arXiv:2412.06410); :meth:`BatchTopK.to_jumprelu` exports it as a JumpReLU.
* :class:`JumpReLU` — ``x · H(x − θ)`` with a learned per-feature threshold ``θ``; trained with
  straight-through pseudo-derivatives for ``θ`` built on a rectangle kernel of bandwidth ``ε``
  (Rajamanoharan et al. 2024, *Jumping Ahead: Improving Reconstruction Fidelity with JumpReLU
  Sparse Autoencoders*, arXiv:2407.14435, eqs. 11–12; the CLT activation, Ameisen et al. 2025, *Circuit Tracing*,
  cross-layer transcoders).
* :class:`AbsTopK` — keep the ``k`` pre-activations of largest magnitude per row, signed (no ReLU)
  (SAELens ``abstopk``; "AbsTopK", arXiv:2510.00404).
* :class:`GroupMax` — split the ``d_sae`` features into ``k`` contiguous groups and keep each
  group's largest ReLU'd pre-activation (EleutherAI sparsify ``activation="groupmax"``,
  ``sparsify/fused_encoder.py``).

:func:`make_activation` builds one from a config name and parameters (the small registry SAELens
keeps per architecture: ``"relu"`` = SAELens ``standard``, ``"topk"``, ``"batchtopk"``, ``"jumprelu"``).
Needs torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from .._checks import is_int, is_real
from .._typing import Float
from ..errors import CheckpointError
from .sparse_decode import batch_topk_indices, topk_indices

#: dtypes whose BatchTopK threshold keeps an fp32 running estimate beside it
_LOW_PRECISION = (torch.bfloat16, torch.float16)
def _topk_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` with all but its ``k`` largest entries along the last dim set to zero, then ReLU'd."""
    vals, idx = x.topk(min(k, x.shape[-1]), dim=-1, sorted=False)
    return torch.zeros_like(x).scatter_(-1, idx, vals.relu())  # in place: no copy of the zeros


def _rectangle(u: torch.Tensor) -> torch.Tensor:
    """The rectangle kernel ``K(u) = 1[-1/2 < u < 1/2]`` (Rajamanoharan et al. 2024, §3)."""
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class _JumpReLUFunction(torch.autograd.Function):
    """``x · H(x − θ)``; backward: ``∂/∂x = H(x − θ)``, ``∂/∂θ = −(θ/ε) K((x − θ)/ε)`` (eq. 11).

    In the ``setup_context`` form with a vmap rule and a forward-mode derivative (the same pseudo-derivatives):
    ``torch.func`` transforms (``grad``, ``vmap``, ``jvp``, ``jacrev``) take it (until 2026-11-28 they refused it
    with torch's ``RuntimeError: ... it must override the setup_context staticmethod``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        return x * (x > threshold).to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, threshold, bandwidth = inputs
        ctx.save_for_backward(x, threshold)
        ctx.save_for_forward(x, threshold)
        ctx.bandwidth = bandwidth

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_x = grad * (x > threshold).to(grad.dtype)
        grad_t = -(threshold / eps) * _rectangle((x - threshold) / eps) * grad
        return grad_x, grad_t.sum_to_size(threshold.shape), None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor | None, t_t: torch.Tensor | None, _: Any) -> torch.Tensor:
        x, threshold = ctx.saved_tensors
        out = torch.zeros_like(x) if x_t is None else x_t * (x > threshold).to(x.dtype)
        if t_t is not None:
            out = out - (threshold / ctx.bandwidth) * _rectangle((x - threshold) / ctx.bandwidth) * t_t
        return out


class _StepFunction(torch.autograd.Function):
    """``H(x − θ)``; backward: ``∂/∂x = 0``, ``∂/∂θ = −(1/ε) K((x − θ)/ε)`` (eq. 12); ``torch.func``-ready as
    :class:`_JumpReLUFunction`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        return (x > threshold).to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, threshold, bandwidth = inputs
        ctx.save_for_backward(x, threshold)
        ctx.save_for_forward(x, threshold)
        ctx.bandwidth = bandwidth

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_t = -(1.0 / eps) * _rectangle((x - threshold) / eps) * grad
        return torch.zeros_like(x), grad_t.sum_to_size(threshold.shape), None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor | None, t_t: torch.Tensor | None, _: Any) -> torch.Tensor:
        x, threshold = ctx.saved_tensors
        out = torch.zeros_like(x)
        if t_t is not None:
            out = out - (1.0 / ctx.bandwidth) * _rectangle((x - threshold) / ctx.bandwidth) * t_t
        return out


class ReLU(nn.Module):
    """``max(0, x)``: the activation of L1-penalised SAEs (Bricken et al. 2023, *Towards Monosemanticity*).

    Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/standard_sae.py``.
    """

    def forward(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """``(*batch, d_sae)`` pre-activations -> ``max(0, x)``, same shape and dtype.

        Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/standard_sae.py``.
        """
        return torch.relu(x)


class TopK(nn.Module):
    """Keep the ``k`` largest pre-activations of each row (last dim), ReLU'd; zeros elsewhere.

    Gao et al. 2024 (arXiv:2406.04093), EleutherAI sparsify, SAELens ``topk``. Gradients flow to
    the kept entries only. Ties at the k-th value are broken by ``torch.topk``.

    Source: Gao et al. 2024, *Scaling and evaluating sparse autoencoders*; SAELens ``sae_lens/saes/topk_sae.py``;
    sparsify ``sparsify/fused_encoder.py``.
    """

    def __init__(self, k: int) -> None:
        super(TopK, self).__init__()
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
            raise CheckpointError(f"TopK needs a positive int k, got {k!r}")
        self.k = k

    def forward(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """``(*batch, d_sae)`` -> same shape and dtype: the ``k`` largest of each row, ReLU'd; zeros elsewhere.

        Source: Gao et al. 2024, *Scaling and evaluating sparse autoencoders*; SAELens ``sae_lens/saes/topk_sae.py``;
        sparsify ``sparsify/fused_encoder.py``.
        """
        return _topk_mask(x, self.k)

    def select(self, pre: Float[torch.Tensor, "n d_sae"]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, cols, offsets)`` of the entries :meth:`forward` keeps (sparse fast path,
        :mod:`.sparse_decode`); ``pre`` is 2-D and should carry no graph.

        Source: Gao et al. 2024, *Scaling and evaluating sparse autoencoders*; SAELens ``sae_lens/saes/topk_sae.py``;
        sparsify ``sparsify/fused_encoder.py``.
        """
        return topk_indices(pre, self.k)

    def activate_selected(self, selected: Float[torch.Tensor, " nnz"]) -> Float[torch.Tensor, " nnz"]:
        """The kept entries' activations from their pre-activations (ReLU), as :meth:`forward`.

        Source: Gao et al. 2024, *Scaling and evaluating sparse autoencoders*; SAELens ``sae_lens/saes/topk_sae.py``;
        sparsify ``sparsify/fused_encoder.py``.
        """
        return selected.relu()

    def extra_repr(self) -> str:
        """``k`` for ``repr``.

        Source: Gao et al. 2024, *Scaling and evaluating sparse autoencoders*; SAELens ``sae_lens/saes/topk_sae.py``;
        sparsify ``sparsify/fused_encoder.py``.
        """
        return f"k={self.k}"


class JumpReLU(nn.Module):
    """``JumpReLU_θ(x) = x · H(x − θ)`` with a learned threshold ``θ: (d_sae,)``.

    Rajamanoharan et al. 2024 (arXiv:2407.14435): the output gets the ordinary derivative in
    ``x`` (``H(x − θ)``) and the straight-through pseudo-derivative
    ``∂/∂θ = −(θ/ε) K((x − θ)/ε)`` with the rectangle kernel ``K`` of bandwidth ``ε``
    (eq. 11); :meth:`l0` is the differentiable L0 ``Σ H(x − θ)`` with ``∂/∂θ = −(1/ε) K(…)``
    (eq. 12), for the sparsity loss. Used by Gemma Scope and by CLTs (Ameisen et al. 2025, *Circuit Tracing*,
    cross-layer transcoders).

    Args:
        d_sae: number of features (size of ``threshold``).
        threshold: initial threshold, a float for every feature or a ``(d_sae,)`` tensor.
        bandwidth: ``ε`` of the pseudo-derivatives (the paper uses 0.001).

    Raises:
        CheckpointError: ``bandwidth`` not a positive finite number; ``threshold`` not a finite number or a finite
            ``(d_sae,)`` tensor (:func:`check_activation_params`).

    Source: Rajamanoharan et al. 2024 (JumpReLU SAEs), eqs. 11–12; SAELens ``sae_lens/saes/jumprelu_sae.py``.
    """

    def __init__(self, d_sae: int, threshold: float | torch.Tensor = 0.0, bandwidth: float = 1e-3) -> None:
        super(JumpReLU, self).__init__()
        check_width(d_sae, "JumpReLU")
        check_activation_params("jumprelu", d_sae, {"threshold": threshold, "bandwidth": bandwidth})
        theta = torch.as_tensor(threshold, dtype=torch.float32, device="cpu")  # moved with the module
        self.threshold = nn.Parameter(theta.expand(d_sae).clone())
        self.bandwidth = float(bandwidth)

    def forward(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """``(*batch, d_sae)`` -> same shape and dtype: ``x · H(x − θ)`` (straight-through pseudo-derivatives for
        ``θ`` in training).

        Source: Rajamanoharan et al. 2024 (JumpReLU SAEs), eqs. 11–12; SAELens ``sae_lens/saes/jumprelu_sae.py``.
        """
        return _JumpReLUFunction.apply(x, self.threshold.to(x.dtype), self.bandwidth)

    def l0(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch"]:
        """Active features per row, ``Σ_i H(x_i − θ_i)``, differentiable in ``θ`` (eq. 12).

        Source: Rajamanoharan et al. 2024 (JumpReLU SAEs), eqs. 11–12; SAELens ``sae_lens/saes/jumprelu_sae.py``.
        """
        return _StepFunction.apply(x, self.threshold.to(x.dtype), self.bandwidth).sum(-1)

    def extra_repr(self) -> str:
        """``d_sae`` and ``bandwidth`` for ``repr``.

        Source: Rajamanoharan et al. 2024 (JumpReLU SAEs), eqs. 11–12; SAELens ``sae_lens/saes/jumprelu_sae.py``.
        """
        return f"d_sae={self.threshold.shape[0]}, bandwidth={self.bandwidth}"


class BatchTopK(nn.Module):
    """Batch top-k (Bussmann et al. 2024, arXiv:2412.06410).

    Training (``self.training``): over the flattened batch of ``n`` rows, keep the ``k · n``
    largest ReLU'd pre-activations (so rows may have more or fewer than ``k`` active features,
    ``k`` on average), and update the inference threshold ``θ`` with the smallest kept positive
    activation (first batch: set; then an exponential moving average of rate ``threshold_lr``,
    as SAELens's ``topk_threshold``).

    The estimate is updated in fp32 (fp64 for an fp64 module) whatever the module's dtype: a bf16 / fp16
    module keeps its running estimate as an fp32 tensor of its own (not in the state dict) and the ``threshold``
    buffer (what is saved and used at inference) as its rounding. Updated in bf16 an EMA step below half a bf16
    step of ``θ`` (``threshold_lr · |Δ| < 2^-9 θ``: batch minima within 20 % of ``θ``) rounds away and the estimate
    stalls (until 2026-11-27 it did, outside the :class:`~nnsight_lorsa.training.trainer.Trainer`'s fp32 masters). A
    write to the buffer from outside (``load_state_dict``, :meth:`set_threshold`, ``threshold.mul_``) restarts the
    running estimate from the buffer's value.

    Under data parallelism (:func:`~nnsight_lorsa.training.distributed.global_batch`, which
    :class:`~nnsight_lorsa.training.distributed.DataParallel` sets around each loss) the statistic the estimate is
    updated from is combined over the ranks (the mean of the ranks' smallest kept activations, weighted by their kept
    entries), so every rank holds the same estimate. The
    batch rule itself stays per rank (``k · n`` of the rank's ``n`` rows), so the estimate approximates, not equals,
    that of one process on the concatenated batch (whose statistic is the smallest of the global top ``k · N``).

    Inference (eval mode): ``x · 1[x > θ]`` per row — independent of the rest of the batch, as
    the paper prescribes. Until a threshold has been estimated (``n_updates == 0``) and none was
    set, eval mode falls back to the batch rule. :meth:`to_jumprelu` exports ``θ`` as the
    per-feature threshold of an equivalent :class:`JumpReLU`.

    Args:
        k: mean number of active features per row.
        d_sae: number of features (for :meth:`to_jumprelu`).
        threshold_lr: EMA rate of the threshold estimate.

    Raises:
        CheckpointError: ``k`` not a positive int, ``threshold_lr`` not a number in ``[0, 1]`` (NaN made every later
            threshold NaN): :func:`check_activation_params`.

    Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
    """

    threshold: torch.Tensor
    #: buffers that a training forward updates (an estimate, not a gradient step): the
    #: :class:`~nnsight_lorsa.training.trainer.Trainer` puts them back when it refuses a step, and keeps fp32 masters
    #: of the bf16 / fp16 ones (saved in its checkpoints and resumed: the module's own fp32 estimate is not in the
    #: state dict)
    trained_buffers: ClassVar[tuple[str, ...]] = ("threshold", "n_updates")
    #: the rank-combining functions of :func:`~nnsight_lorsa.training.distributed.global_batch` (the innermost last;
    #: empty: one process). A class attribute, not a module global (nor a ``contextvars.ContextVar``): this class
    #: travels to NDIF by value (``remote.register``), with its own attributes but not its module's globals
    #: (``tests/test_remote.py``, ``test_every_activation_kind_ships_to_ndif``)
    global_batch: ClassVar[list[Callable[[torch.Tensor, int], torch.Tensor | None]]] = []
    n_updates: torch.Tensor

    def __init__(self, k: int, d_sae: int, threshold_lr: float = 0.01) -> None:
        super(BatchTopK, self).__init__()
        check_width(d_sae, "BatchTopK")
        check_activation_params("batchtopk", d_sae, {"k": k, "threshold_lr": threshold_lr})
        self.k = k
        self.d_sae = d_sae
        self.threshold_lr = float(threshold_lr)
        self.register_buffer("threshold", torch.zeros((), device="cpu"))  # moved with the module
        self.register_buffer("n_updates", torch.zeros((), dtype=torch.long, device="cpu"))
        # ``n_updates > 0`` mirrored on the host, so that an eval forward reads no device value (a host sync on
        # CUDA); ``_seen`` stamps the buffer it mirrors (object, in-place version): a buffer written or replaced
        # other than by these methods is read once again (:meth:`_batch_rule`)
        self._estimated = False
        self._seen = self._stamp()
        #: the fp32 running estimate of a bf16 / fp16 ``threshold`` (None: not made yet, or dropped), valid while the
        #: buffer is as :meth:`update_threshold` left it (``_exact_seen``: its object and in-place version)
        self._exact: torch.Tensor | None = None
        self._exact_seen: tuple[int, int] = (0, -1)

    def _stamp(self) -> tuple[int, int]:
        return id(self.n_updates), self.n_updates._version

    def _note(self, estimated: bool) -> None:
        self._estimated = estimated
        self._seen = self._stamp()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``.to`` / ``.cuda`` / ``.half``...: the moved ``n_updates`` holds the same value, still mirrored. A valid
        fp32 running estimate of a bf16 / fp16 ``threshold`` is carried: cast to another low-precision dtype, the
        buffer is the estimate's rounding to it; to fp32 / fp64, the buffer is the estimate itself (until 2026-11-28
        the cast of the rounded buffer: a bf16 module's ``.float()`` lost the estimate, 1.0781 where it was 1.0771)."""
        fresh = self._stamp() == self._seen
        exact = self._exact if self._exact_seen == self._threshold_stamp() else None
        dtype = self.threshold.dtype
        out = super(BatchTopK, self)._apply(fn, *args, **kwargs)
        if fresh:
            self._seen = self._stamp()
        self._exact = None
        theta = self.threshold
        if exact is not None and (theta.dtype != dtype or exact.device != theta.device) \
                and theta.device.type != "meta" and theta.dtype.is_floating_point:
            with torch.no_grad():
                theta.copy_(exact)  # the estimate, rounded to the new dtype (exact where fp32 / fp64)
        if exact is not None and theta.dtype in _LOW_PRECISION:  # still low precision: the estimate moves
            self._exact = exact.to(theta.device)
            self._exact_seen = self._threshold_stamp()
        return out

    def _threshold_stamp(self) -> tuple[int, int]:
        return id(self.threshold), self.threshold._version

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles (``copy.deepcopy``, ``pickle``): the state, with whether the fp32 running estimate and
        the host mirror are valid, so that :meth:`__setstate__` stamps the copy's own buffers (nn.Module's deep copy
        copied both but left their stamps naming the original's buffers: the copy restarted its estimate from the
        rounded bf16 / fp16 buffer until 2026-11-28)."""
        state = dict(self.__dict__)
        state["_stamps_valid"] = (self._exact is not None and self._exact_seen == self._threshold_stamp(),
                                  self._stamp() == self._seen)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        exact, fresh = state.pop("_stamps_valid", (False, False))
        super(BatchTopK, self).__setstate__(state)
        if exact:
            self._exact_seen = self._threshold_stamp()
        if fresh:
            self._seen = self._stamp()

    def _running(self) -> torch.Tensor:
        """The running estimate of ``θ`` in at least fp32: the buffer itself when it is fp32 / fp64, else the fp32
        estimate kept beside it (made again from the buffer when the buffer was written from outside)."""
        theta = self.threshold
        if theta.dtype not in _LOW_PRECISION:
            return theta
        if self._exact is None or self._exact_seen != self._threshold_stamp() or self._exact.device != theta.device:
            self._exact = theta.detach().to(torch.float32)
        return self._exact

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """A host ``n_updates`` in the loaded state is mirrored as it is read (one on a device: at the next
        eval forward, :meth:`_batch_rule`)."""
        errors = args[-1]
        before = len(errors)
        super(BatchTopK, self)._load_from_state_dict(state_dict, prefix, *args)
        value = state_dict.get(prefix + "n_updates")
        if len(errors) == before and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            self._note(int(value) != 0)

    def batch_topk(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """The training rule: keep the ``k · n_rows`` largest ReLU'd entries of the whole batch.

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        flat = x.reshape(-1)
        n_rows = flat.numel() // x.shape[-1] if x.shape[-1] else 0
        keep = min(self.k * n_rows, flat.numel())
        vals, idx = flat.relu().topk(keep, sorted=False)
        return torch.zeros_like(flat).scatter(0, idx, vals).view_as(x)

    @torch.no_grad()
    def update_threshold(self, acts: torch.Tensor) -> None:
        """Fold the smallest positive kept activation of a batch into the threshold estimate (in fp32 at least; the
        statistic combined over the ranks inside :func:`~nnsight_lorsa.training.distributed.global_batch`).

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        positive = acts[acts > 0]
        reduce = self.global_batch[-1] if self.global_batch else None
        running = self._running()
        if reduce is not None:  # every rank takes part, with or without a positive activation
            # weight: the entries kept (k per row: the dense acts' k · rows, the sparse path's nnz)
            kept = min(self.k * (acts.numel() // acts.shape[-1]), acts.numel()) if acts.dim() > 1 else acts.numel()
            local = positive.min().to(running.dtype) if positive.numel() else running.new_zeros(())
            found = reduce(local, kept if positive.numel() else 0)
            if found is None:
                return
            smallest = found.to(device=running.device, dtype=running.dtype)
        elif positive.numel() == 0:
            return
        else:
            smallest = positive.min().to(running.dtype)
        if not self._batch_estimated():
            running.copy_(smallest)
        else:
            running.lerp_(smallest, self.threshold_lr)
        if running is not self.threshold:
            self.threshold.copy_(running)  # rounded once
            self._exact_seen = self._threshold_stamp()
        self.n_updates += 1
        self._note(True)

    def set_threshold(self, value: float) -> None:
        """Set ``θ`` (e.g. measured on held-out data) and use it at inference from now on.

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        self.threshold.fill_(float(value))
        self.n_updates.clamp_(min=1)  # max(1, n_updates), on the buffer's device
        self._note(True)

    def forward(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """``(*batch, d_sae)`` -> same shape and dtype: the batch-wide top ``k · n_rows`` when the batch rule applies
        (updating the threshold in training), else ``x · H(x − threshold)``.

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        if self._batch_rule():
            acts = self.batch_topk(x)
            if self.training:
                self.update_threshold(acts.detach())
            return acts
        return x * (x > self.threshold.to(x.dtype)).to(x.dtype)

    def _batch_rule(self) -> bool:
        return self.training or not self._batch_estimated()

    def _batch_estimated(self) -> bool:
        """``n_updates > 0``, from the host mirror; read from the buffer (a device read) only when it was written or
        replaced from outside (e.g. ``n_updates.zero_()``, a copy of the module), once. On ``meta`` (a module moved
        there for shapes: nothing to read) the mirror is kept as it is."""
        if self._stamp() != self._seen and not self.n_updates.is_meta:
            self._note(int(self.n_updates) != 0)
        return self._estimated

    def select(self, pre: Float[torch.Tensor, "n d_sae"]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, cols, offsets)`` of the entries :meth:`forward` keeps, sorted by row (sparse
        fast path, :mod:`.sparse_decode`): the batch rule in training, ``pre > θ`` at inference.

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        if self._batch_rule():
            return batch_topk_indices(pre, self.k)
        rows, cols = (pre > self.threshold.to(pre.dtype)).nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=pre.shape[0])
        return rows, cols, torch.cumsum(counts, 0) - counts

    def activate_selected(self, selected: Float[torch.Tensor, " nnz"]) -> Float[torch.Tensor, " nnz"]:
        """The kept entries' activations (ReLU'd under the batch rule; the threshold estimate is
        updated in training, as :meth:`forward` does).

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        if not self._batch_rule():
            return selected
        acts = selected.relu()
        if self.training:
            self.update_threshold(acts.detach())
        return acts

    def to_jumprelu(self, bandwidth: float = 1e-3) -> JumpReLU:
        """A :class:`JumpReLU` with per-feature threshold ``θ`` (all equal): the inference rule.

        Identical outputs to this module in eval mode (for ``θ ≥ 0``, ``x · 1[x > θ]``).

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        return JumpReLU(self.d_sae, threshold=float(self.threshold), bandwidth=bandwidth).to(self.threshold.device)

    def extra_repr(self) -> str:
        """``k``, ``d_sae`` and the threshold for ``repr``.

        Source: Bussmann et al. 2024, *BatchTopK Sparse Autoencoders*; SAELens ``sae_lens/saes/batchtopk_sae.py``.
        """
        return f"k={self.k}, d_sae={self.d_sae}, threshold={float(self.threshold):.4g}"


class AbsTopK(nn.Module):
    """Keep the ``k`` entries of largest ``|x|`` per row (last dim) with their sign; zeros elsewhere.

    SAELens ``abstopk`` (``sae_lens/saes/abstopk_sae.py``; arXiv:2510.00404): features may fire
    negative. Ties at the k-th magnitude are broken by ``torch.topk``.

    Source: SAELens ``sae_lens/saes/abstopk_sae.py``.
    """

    def __init__(self, k: int) -> None:
        super(AbsTopK, self).__init__()
        if not isinstance(k, int) or k <= 0:
            raise CheckpointError(f"AbsTopK needs a positive int k, got {k!r}")
        self.k = k

    def forward(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """``(*batch, d_sae)`` -> same shape and dtype: the ``k`` entries of largest ``|x|`` of each row, signed;
        zeros elsewhere.

        Source: SAELens ``sae_lens/saes/abstopk_sae.py``.
        """
        idx = x.abs().topk(min(self.k, x.shape[-1]), dim=-1, sorted=False).indices
        return torch.zeros_like(x).scatter(-1, idx, x.gather(-1, idx))

    def extra_repr(self) -> str:
        """``k`` for ``repr``.

        Source: SAELens ``sae_lens/saes/abstopk_sae.py``.
        """
        return f"k={self.k}"


class GroupMax(nn.Module):
    """The largest ReLU'd pre-activation of each of ``k`` contiguous feature groups; zeros elsewhere.

    EleutherAI sparsify ``groupmax`` (``sparsify/fused_encoder.py``: ``relu(x).unflatten(-1, (k, -1))
    .max(-1)``): ``d_sae`` must be a multiple of ``k``; a row has at most ``k`` active features.

    Raises:
        CheckpointError: ``d_sae`` not a positive int, ``k`` not a positive int dividing it (``True`` was ``k=1``).

    Source: sparsify ``sparsify/fused_encoder.py`` (``activation="groupmax"``).
    """

    def __init__(self, k: int, d_sae: int) -> None:
        super(GroupMax, self).__init__()
        check_width(d_sae, "GroupMax")
        check_activation_params("groupmax", d_sae, {"k": k})  # a positive int k (True is no k) dividing d_sae
        self.k = k

    def forward(self, x: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """``(*batch, d_sae)`` -> same shape and dtype: each of the ``k`` groups' largest ReLU'd entry; zeros
        elsewhere.

        Source: sparsify ``sparsify/fused_encoder.py`` (``activation="groupmax"``).
        """
        vals, idx = x.relu().unflatten(-1, (self.k, -1)).max(dim=-1)
        idx = idx + torch.arange(0, x.shape[-1], x.shape[-1] // self.k, device=x.device)
        return torch.zeros_like(x).scatter(-1, idx, vals)

    def extra_repr(self) -> str:
        """``k`` for ``repr``.

        Source: sparsify ``sparsify/fused_encoder.py`` (``activation="groupmax"``).
        """
        return f"k={self.k}"


#: config names of the activations, as stored in ``SAEConfig.activation``.
ACTIVATIONS = ("relu", "topk", "batchtopk", "jumprelu", "abstopk", "groupmax")
#: the parameters each activation takes (``activation_params`` keys) and those it needs
PARAMETERS = {"relu": (), "topk": ("k",), "batchtopk": ("k", "threshold_lr"), "jumprelu": ("threshold", "bandwidth"),
              "abstopk": ("k",), "groupmax": ("k",)}
REQUIRED = {"topk": ("k",), "batchtopk": ("k",), "abstopk": ("k",), "groupmax": ("k",)}


def _real(v: Any) -> bool:
    return is_real(v)


def check_width(d_sae: Any, where: str) -> None:
    """An activation's number of features: a positive int, else :class:`CheckpointError` naming ``where``."""
    if not is_int(d_sae) or d_sae <= 0:
        raise CheckpointError(f"{where}: d_sae (the number of features) must be a positive int, got {d_sae!r}")


def check_activation_params(name: Any, d_sae: int | None, params: Any) -> None:
    """Raise :class:`CheckpointError` unless ``params`` are valid parameters of activation ``name`` for
    ``d_sae`` features (what :func:`make_activation` would build, checked without building it): known keys
    only, the required ones present, ``k`` a positive int ``<= d_sae`` (dividing it for ``groupmax``),
    ``threshold`` a finite number (or a finite ``(d_sae,)`` tensor), ``bandwidth`` a positive finite number,
    ``threshold_lr`` a number in ``[0, 1]``. The message names the parameter.

    ``d_sae=None`` (what the configs check) skips the checks against the width (``k <= d_sae``, ``groupmax``
    divisibility, the threshold's length): the module constructor makes them, where the checkpoint loaders
    name the file in the message; a ``d_sae`` given must be a positive int."""
    if d_sae is not None:
        check_width(d_sae, str(name))
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise CheckpointError(f"unknown activation {name!r}; known: {list(ACTIVATIONS)}")
    if params is not None and not isinstance(params, Mapping):
        raise CheckpointError(f"activation_params of {name!r} must be a mapping, got {params!r}")
    params = dict(params or {})
    unknown = sorted(str(k) for k in set(params) - set(PARAMETERS[name]))
    if unknown:
        raise CheckpointError(f"bad parameters {unknown} for activation {name!r} (activation_params; it takes "
                              f"{list(PARAMETERS[name])})")
    missing = [k for k in REQUIRED.get(name, ()) if k not in params]
    if missing:
        raise CheckpointError(f"activation {name!r} needs the parameter(s) {missing} in activation_params")
    if "k" in params:
        k = params["k"]
        if not is_int(k) or int(k) <= 0:
            raise CheckpointError(f"{name} needs a positive int k, got {k!r}")
        k = int(k)
        if d_sae is not None and k > d_sae:
            raise CheckpointError(f"{name} k = {k} exceeds the number of features d_sae = {d_sae}")
        if d_sae is not None and name == "groupmax" and d_sae % k:
            raise CheckpointError(f"groupmax k = {k} must divide d_sae = {d_sae}")
    if "threshold" in params:
        t = params["threshold"]
        if isinstance(t, torch.Tensor):
            if t.dim() > 1 or (t.dim() == 1 and d_sae is not None and t.shape[0] != d_sae) \
                    or not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"jumprelu threshold must be a finite float or ({d_sae},) tensor, "
                                      f"got shape {tuple(t.shape)}")
        elif not _real(t) or not math.isfinite(t):
            raise CheckpointError(f"jumprelu threshold must be a finite number, got {t!r}")
    if "bandwidth" in params:
        bw = params["bandwidth"]
        if not _real(bw) or not math.isfinite(bw) or bw <= 0:
            raise CheckpointError(f"jumprelu bandwidth must be a positive finite number, got {bw!r}")
    if "threshold_lr" in params:
        lr = params["threshold_lr"]
        if not _real(lr) or not 0 <= lr <= 1:
            raise CheckpointError(f"batchtopk threshold_lr must be a number in [0, 1], got {lr!r}")


def make_activation(name: str, d_sae: int, params: Mapping[str, Any] | None = None) -> nn.Module:
    """Build the activation ``name`` for ``d_sae`` features from config parameters.

    ``"relu"`` (no parameters), ``"topk"`` (``k``), ``"batchtopk"`` (``k``, ``threshold_lr``),
    ``"jumprelu"`` (``threshold``, ``bandwidth``), ``"abstopk"`` (``k``), ``"groupmax"`` (``k``).

    Raises:
        CheckpointError: unknown name, or parameters the activation does not take or out of range
            (:func:`check_activation_params`).

    Source: SAELens ``sae_lens/saes/*.py`` (a small registry per architecture name).
    """
    check_width(d_sae, f"make_activation({name!r})")
    check_activation_params(name, d_sae, params)
    params = dict(params or {})
    try:
        if name == "relu":
            return ReLU(**params)
        if name == "topk":
            return TopK(**params)
        if name == "batchtopk":
            return BatchTopK(d_sae=d_sae, **params)
        if name == "jumprelu":
            return JumpReLU(d_sae, **params)
        if name == "abstopk":
            return AbsTopK(**params)
        if name == "groupmax":
            return GroupMax(d_sae=d_sae, **params)
    except TypeError as e:
        raise CheckpointError(f"bad parameters {params} for activation {name!r}: {e}") from e
    raise CheckpointError(f"unknown activation {name!r}; known: {list(ACTIVATIONS)}")
