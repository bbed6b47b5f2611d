"""Sparse-attention post-training: minimise expected edges subject to ``CE <= τ`` (Draye et al. 2025 §3.2).

Each step draws a batch of training windows — batch ``i`` of a
:class:`~..training.dataset.TokenDataset` (one window per document from its start, padding out of its
``target_mask``: what a corpus of documents needs), or ``batch_size`` random windows ``[BOS] +
(seq_len - 1)`` tokens of a token stream that is one long text — runs the gated model in training
mode (hard straight-through gate samples), and descends the Lagrangian (Eq. 5)

    L = E|A| / N_allowed  +  λ (CE − τ)

where ``E|A|/N_allowed`` is the expected fraction of open edges over all layers, heads and allowed
(causal) query-key pairs of the windows' real tokens (Eq. 3, normalised so that λ is on a nats scale; a
right-padded window's padding, after its last ``target_mask`` position, counts neither there nor in the logged
fractions: :func:`real_positions`) and λ follows the GECO rule
(:class:`~.geco.GECO`). CE counts the predictions the windows' ``target_mask`` keeps, for τ and for
the constraint alike. At the start the base model's CE on the training windows is measured; a τ that
is slack by more than ``max_initial_slack`` of it (the constraint would hold from step 0 and only
sparsity would be optimised) raises :class:`~.errors.VacuousConstraintError` unless
``allow_slack_constraint``. Full fine-tuning (AdamW; the gate biases get their own learning rate; fp16 and bf16
weights through fp32 master copies, :mod:`~..training.master_weights`) or
LoRA (``peft``, ``lora_rank``; the LoRA matrices and gate biases train, the rest is frozen).

Checkpoints (``checkpoint.safetensors`` + ``checkpoint.json``: trainable parameters, AdamW state,
GECO state, the data and global RNG states, the step and the history) are written atomically and
verified on load by :mod:`~..training.checkpoint_io` (the trainer's own: temporary sibling, fsync,
rename, sha256 manifest) and resume bit-exactly. CE is training's :func:`~..training.metrics.next_token_ce`,
the BOS rule :func:`~..training.dataset.special_token_id`, the windows :class:`~..training.dataset.TokenDataset`'s.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from .._checks import check_flag, check_int, check_real, is_int
from .._placement import is_index_dtype
from .._typing import Int
from ..envoy.nnsight_internals import check_token_ids, hf_module, vocabulary_size
from ..errors import (
    ArgumentError,
    CheckpointError,
    GateConfigError,
    GateNotInstalledError,
    HeldoutConstraintWarning,
    NonFiniteError,
    VacuousConstraintError,
)
from ..formats.validate import count_non_finite
from ..training.checkpoint_io import check_checkpointing, checkpoint_exists, verified_checkpoint, write_checkpoint
from ..training.dataset import TokenDataset, special_token_id
from ..training.master_weights import MasterWeights
from ..training.metrics import next_token_ce
from ..training.schedule import wsd_lr_factor
from ..training.train_config import OptimConfig
from .geco import GECO
from .install import (
    counting_positions,
    edge_statistics,
    expected_edge_fraction,
    get_gates,
    install_gated_attention,
    set_gate_mode,
)

CHECKPOINT_TENSORS = "checkpoint.safetensors"
CHECKPOINT_JSON = "checkpoint.json"


@contextmanager
def _dense_gates(model: Any) -> Iterator[None]:
    """Inside: every gate of ``model`` in ``dense`` mode — the base model's attention, every allowed edge open
    (in eval mode a ``gated`` gate closes the edges whose logit is ≤ 0: at ``init_bias=5`` 17 % of the embedded
    model's, 0.009 nats of CE that τ took in until 2026-11-29); after it, each gate's mode as before."""
    gates = list(get_gates(model).values())
    modes = [gate.mode for gate in gates]
    set_gate_mode(model, "dense")
    try:
        yield
    finally:
        for gate, mode in zip(gates, modes, strict=True):
            gate.mode = mode


@dataclass
class SparseTrainConfig(OptimConfig):
    """Hyper-parameters of :class:`SparseAttentionTrainer` (defaults: a short CPU run on a tiny model).

    The settings every trainer shares come from :class:`~..training.train_config.OptimConfig` (named and
    checked as there, :class:`~..errors.ArgumentError` at construction), with this trainer's defaults:
    ``total_steps`` (300), ``lr`` (1e-3, the model's weights; the gate biases take ``gate_lr``), AdamW's
    ``betas`` ((0.9, 0.95)), ``grad_clip`` (1.0; 0: none) and ``decay_frac`` (0.0): over that last fraction
    of ``total_steps`` both learning rates decay linearly to 10% (less step-to-step noise in the final model).

    ``target_ce`` is τ (nats/token); ``None`` measures the base model's CE on ``target_batches``
    training batches at the start (the paper's choice, §4: "the loss achieved on the training set").
    ``lora_rank = None`` is full fine-tuning; otherwise LoRA on all linear layers (``peft``,
    ``target_modules="all-linear"``). ``init_bias`` is the gates' starting bias (paper footnote 1).
    ``target_margin`` (nats) tightens the constraint to ``CE <= τ - margin``, slack for the gap
    between training and held-out CE.
    ``recover_fraction``: over that last fraction of ``total_steps`` the gates are deterministic (as at
    evaluation, so no gradient reaches them) and the loss is the CE alone: the model adapts to its
    final edge set (not in the paper; 0 disables).
    ``bos_id``: the id every window starts with; default (None) the model's own BOS, from its
    tokenizer, else its config's ``bos_token_id`` (:func:`resolve_bos_id`).
    ``max_initial_slack``: the vacuous-constraint bound. At the start the base model's CE on the
    training windows (``base_ce``, eval mode, every gate dense: the base model) is measured;
    ``slack = (τ − target_margin) − base_ce`` (nats). ``slack > max_initial_slack · base_ce`` (default: τ more
    than 10% above the base CE) means the constraint holds from step 0 by a wide margin: GECO only lowers λ and
    the gates close as far as sparsity pushes them, whatever the CE. That raises
    :class:`~.errors.VacuousConstraintError`; ``allow_slack_constraint=True`` (experts: a deliberately loose τ)
    makes it a warning.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §3.2 (constrained
    optimisation).
    """

    total_steps: int = 300
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    decay_frac: float = 0.0
    batch_size: int = 16
    seq_len: int = 64
    gate_lr: float = 5e-2
    weight_decay: float = 0.0
    init_bias: float = 5.0
    temperature: float = 1.0
    target_ce: float | None = None
    target_batches: int = 8
    geco_lr: float = 1.0
    geco_ema: float = 0.9
    init_lambda: float = 1.0
    min_lambda: float = 1e-3
    max_lambda: float = 1e4
    target_margin: float = 0.0
    recover_fraction: float = 0.0
    lora_rank: int | None = None
    lora_alpha: int = 16
    seed: int = 0
    bos_id: int | None = None
    max_initial_slack: float = 0.1
    allow_slack_constraint: bool = False

    def validate(self) -> None:
        """Check every field (also run at construction, and by :class:`SparseAttentionTrainer` on the config it is
        given): the shared fields as :meth:`~..training.train_config.OptimConfig.validate`; then integers are
        ``int`` (``bool`` is not one) and floats finite real numbers: ``batch_size``, ``target_batches`` ≥ 1,
        ``seq_len`` ≥ 2 (BOS and one predicted token); ``gate_lr``, ``temperature``, ``geco_lr``, ``lora_alpha``
        > 0; ``weight_decay``, ``target_margin``, ``max_initial_slack`` ≥ 0; ``init_bias`` any finite number;
        ``target_ce`` None or > 0 (nats); ``geco_ema`` in ``[0, 1)``; ``0 < min_lambda ≤ init_lambda ≤
        max_lambda``; ``recover_fraction`` in ``[0, 1)`` (1 would never train the gates); ``lora_rank`` None or
        ≥ 1; ``seed`` an int ≥ 0; ``bos_id`` None or an int ≥ 0 (the model's vocabulary bounds it:
        :func:`resolve_bos_id`); ``allow_slack_constraint`` a bool.

        Raises:
            ArgumentError: the first field that breaks its rule, named (``SparseTrainConfig.<field>``) with its
                value. A wrong value here would fail deep in torch or peft, or train silently wrong (a negative
                ``gate_lr`` opens the gates; ``allow_slack_constraint="no"`` is truthy).

        Source: Draye et al. 2025 §3.2 (the GECO constraint and its λ); ours (the fields and checks).
        """
        super().validate()
        who = "SparseTrainConfig"
        for name in ("batch_size", "target_batches"):
            check_int(who, name, getattr(self, name))
        check_int(who, "seq_len", self.seq_len, least=2)
        check_int(who, "seed", self.seed, least=0)
        for name in ("gate_lr", "temperature", "geco_lr", "lora_alpha", "init_lambda", "min_lambda", "max_lambda"):
            check_real(who, name, getattr(self, name), positive=True)
        for name in ("weight_decay", "target_margin", "max_initial_slack"):
            check_real(who, name, getattr(self, name))
        check_real(who, "init_bias", self.init_bias, signed=True)
        check_real(who, "geco_ema", self.geco_ema, upper=1.0, upper_open=True)
        check_real(who, "recover_fraction", self.recover_fraction, upper=1.0, upper_open=True)
        if self.target_ce is not None:
            check_real(who, "target_ce", self.target_ce, positive=True)
        if not self.min_lambda <= self.init_lambda <= self.max_lambda:
            raise ArgumentError(f"{who} needs min_lambda <= init_lambda <= max_lambda, got {self.min_lambda!r}, "
                                f"{self.init_lambda!r}, {self.max_lambda!r}")
        if self.lora_rank is not None:
            check_int(who, "lora_rank", self.lora_rank)
        if self.bos_id is not None:
            check_int(who, "bos_id", self.bos_id, least=0)
        if not isinstance(self.allow_slack_constraint, bool):
            raise ArgumentError(f"{who}.allow_slack_constraint must be a bool, got {self.allow_slack_constraint!r}")


@dataclass
class StepRecord:
    """One training step: CE (nats/token), λ, expected and active edge fractions (this batch)."""

    step: int
    ce: float
    lam: float
    expected_fraction: float
    active_fraction: float


def resolve_bos_id(model: Any, bos_id: int | None = None) -> int:
    """The BOS id windows start with: ``bos_id`` if given, else the model's tokenizer's
    ``bos_token_id`` (an nnsight model's ``tokenizer``), else its config's ``bos_token_id``.

    Raises:
        GateConfigError: none of them gives one (pass ``bos_id``: every window starts with BOS).
        ArgumentError: ``bos_id`` not an int ≥ 0 (``bool`` is not one; ``2.5`` is not rounded), or the id is
            outside the model's vocabulary (its input embedding's rows).
    """
    if bos_id is not None and (not is_int(bos_id) or bos_id < 0):
        raise ArgumentError(f"bos_id must be None or an int >= 0 (a token id), got {bos_id!r}")
    hf = hf_module(model)
    bos = special_token_id(getattr(model, "tokenizer", None), getattr(hf, "config", None), bos_id)
    if bos is not None:
        vocab = vocabulary_size(hf)
        if vocab is not None and not 0 <= bos < vocab:
            raise ArgumentError(f"the BOS id {bos} is outside the model's vocabulary of {vocab} tokens "
                                f"({'bos_id' if bos_id is not None else 'from its tokenizer / config'})")
        return bos
    raise GateConfigError("the model has no BOS id (neither its tokenizer nor its config's bos_token_id); "
                          "windows start with BOS: pass bos_id")


def check_windows_kind(ids: Any, where: str, name: str) -> None:
    """Training or evaluation windows: a :class:`~..training.dataset.TokenDataset` or a 1-D integer token stream.

    Raises:
        ArgumentError: anything else, naming ``where`` and ``name``.
    """
    if isinstance(ids, TokenDataset) or (isinstance(ids, torch.Tensor) and ids.dim() == 1
                                        and is_index_dtype(ids.dtype)):
        return
    got = f"a {ids.dim()}-D {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else f"a {type(ids).__name__}"
    raise ArgumentError(f"{where}: {name} must be a TokenDataset or a 1-D integer token stream, got {got}")


def check_one_text(model: Any, ids: torch.Tensor) -> None:
    """Refuse a 1-D stream that holds the model's EOS id: a concatenation of documents, not one long text.

    Random stream windows of it would start mid-document, where the model's CE is not its CE, so both the
    constraint τ (``target_ce=None`` measures it there) and the CE kept would mean nothing — whatever
    ``target_ce`` is (an independent probe: held-out CE 3.00 → 5.80 with no error).

    Raises:
        GateConfigError: naming the EOS id, how often it occurs and what to pass instead.
    """
    eos = special_token_id(getattr(model, "tokenizer", None), getattr(hf_module(model), "config", None),
                           name="eos_token_id")
    count = 0 if eos is None else int((ids == eos).sum())
    if count:
        raise GateConfigError(
            f"the training stream holds the model's EOS id {eos} {count} time(s): it is a corpus of documents, "
            "and random windows of it start mid-document. Pass TokenDataset.from_documents(tokenizer, documents, "
            "seq_len, config=model.config) (one window per document, from its start) instead of the stream")


def real_positions(target_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``(batch, seq)`` bool: each window's positions up to its last counted one (``target_mask`` True) — the
    window without its right padding, whose edges count in the sparsity term and the edge fractions. None
    (every position) for None. A window with no counted position has none. The positions after a task mask's
    last counted token (an EOS after the answer) are left out with the padding: no counted prediction
    depends on their edges (causal attention)."""
    if target_mask is None:
        return None
    mask = target_mask.to(torch.bool)
    seq = mask.shape[1]
    last = torch.where(mask.any(dim=1), seq - 1 - mask.flip(1).to(torch.int64).argmax(dim=1),
                       torch.full((mask.shape[0],), -1, dtype=torch.int64, device=mask.device))
    return torch.arange(seq, device=mask.device)[None, :] <= last[:, None]


@torch.no_grad()
def evaluate_sparse(model: Any, token_ids: Int[torch.Tensor, " n"] | TokenDataset, seq_len: int = 64,
                    batch_size: int = 16, max_windows: int | None = None, bos_id: int | None = None) -> dict[str, Any]:
    """Held-out CE and edge fractions of a gated model in eval mode (deterministic gates).

    ``token_ids`` a :class:`~..training.dataset.TokenDataset`: its windows as they are (e.g. one per
    document, :meth:`~..training.dataset.TokenDataset.from_documents`), CE over the predictions its
    ``target_mask`` keeps (padding excluded); ``seq_len`` and ``bos_id`` are not used. A 1-D stream
    (one long text; one holding the model's EOS id is a corpus of documents and refused, as the trainer
    refuses it: :func:`check_one_text`): cut into consecutive windows of ``seq_len - 1`` tokens, each evaluated as
    ``[BOS] + window`` (every token predicted once; BOS: ``bos_id``, default the model's own, see
    :func:`resolve_bos_id`). Works in every gate mode (``topk`` and ``dense`` report their kept edges
    as active). Edge fractions count each window's positions up to its last counted one
    (:func:`real_positions`: right padding left out; every position of stream windows), as training's
    sparsity term does.

    Returns:
        ``ce`` (nats/token), ``active_fraction`` and ``expected_fraction`` (over all layers, heads and
        allowed edges), ``active_fraction_per_head`` (``[layer][head]``), ``windows``, ``tokens``.

    Raises:
        GateConfigError: a stream shorter than one window, holding the model's EOS id (:func:`check_one_text`:
            pass ``TokenDataset.from_documents`` / ``TokenDataset.from_ids`` windows instead), or no BOS id for a
            stream.
        ArgumentError: ``token_ids`` neither a ``TokenDataset`` nor a 1-D integer tensor, ``batch_size`` not an int
            ≥ 1, ``max_windows`` not None or an int ≥ 1, a stream's
            ``seq_len`` not an int ≥ 2 (BOS and one predicted token), a BOS id outside the vocabulary
            (:func:`resolve_bos_id`), token ids outside it (they were torch's ``IndexError`` from the embedding) —
            before the model runs.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §3.2 (constrained
    optimisation).
    """
    hf = hf_module(model)
    check_windows_kind(token_ids, "evaluate_sparse", "token_ids")
    check_int("evaluate_sparse", "batch_size", batch_size)
    if max_windows is not None:
        check_int("evaluate_sparse", "max_windows", max_windows)
    if not isinstance(token_ids, TokenDataset):
        check_int("evaluate_sparse", "seq_len", seq_len, least=2)
        bos = resolve_bos_id(model, bos_id)
        check_one_text(model, token_ids)  # as the trainer: a stream of documents is no one text
        if token_ids.numel() < seq_len - 1:
            raise GateConfigError(f"need at least {seq_len - 1} tokens for one window, got {token_ids.numel()}")
        token_ids = TokenDataset.from_ids(token_ids, seq_len, bos_token_id=bos)
    n = len(token_ids) if max_windows is None else min(len(token_ids), max_windows)
    windows = token_ids.tokens[:n]
    check_token_ids(windows, model, "evaluate_sparse: token_ids")
    mask = token_ids.targets(0, n)
    was_training = hf.training
    hf.eval()
    nll, count = 0.0, 0
    exp = act = pos = None
    device = next(hf.parameters()).device
    try:  # the model's mode comes back also when a batch fails (a CUDA OOM, Ctrl-C)
        for i in range(0, n, batch_size):
            x = windows[i:i + batch_size].to(device)
            kept = None if mask is None else mask[i:i + batch_size]
            with counting_positions(hf, real_positions(kept)):  # the padding's edges count nowhere
                logits = hf(input_ids=x).logits
            ce, k = next_token_ce(logits, x, kept)
            nll += ce.item()
            count += k
            st = edge_statistics(hf)
            exp = st.expected if exp is None else exp + st.expected
            act = st.active if act is None else act + st.active
            pos = st.possible if pos is None else pos + st.possible
    finally:
        hf.train(was_training)
    assert exp is not None and act is not None and pos is not None
    return {"ce": nll / count, "active_fraction": float(act.sum() / pos.sum()),
            "expected_fraction": float(exp.sum() / pos.sum()),
            "active_fraction_per_head": (act / pos).tolist(), "windows": n, "tokens": count}


class SparseAttentionTrainer:
    """GECO-constrained sparse-attention post-training of one model (Draye et al. 2025 §3.2, Eq. 4-5).

    Args:
        model: a transformers ``*ForCausalLM`` (or nnsight model wrapping one); gated attention is
            installed with ``config.init_bias`` unless the model already has gates.
        train_ids: the training windows — a :class:`~..training.dataset.TokenDataset` (batch ``i`` =
            its batch ``i`` of ``config.batch_size`` windows with ``config.seed``; its ``seq_len`` must
            be ``config.seq_len``, every window must start with the model's BOS, CE counts its
            ``target_mask``: use :meth:`~..training.dataset.TokenDataset.from_documents` for a corpus
            of documents) — or a 1-D token stream (no BOS) that is one long text, at least ``seq_len``
            tokens, sampled as random ``[BOS] + (seq_len - 1)`` windows.
        config: :class:`SparseTrainConfig`.
        augment: optional ``(batch, generator) -> batch`` applied to every sampled training batch
            (and to the batches that measure τ), drawing randomness only from the given generator
            (e.g. ``_repeat_augment`` of ``scripts/tinymodel.py`` to keep in-context copying in the data).

    Attributes:
        base_ce: the base model's CE on the training windows at the start (eval mode, every gate dense: the
            model before sparsification; τ itself when ``target_ce`` is None). step, history, geco (τ: ``geco.target``).

    Raises:
        GateConfigError: stream shorter than ``seq_len``, or holding the model's EOS id (a corpus of
            documents: :func:`check_one_text`); a dataset whose ``seq_len`` differs from
            ``config.seq_len`` or whose windows do not start with the model's BOS; no BOS id
            (``config.bos_id`` None and the model's tokenizer and config have none).
        VacuousConstraintError: τ slack by more than ``max_initial_slack · base_ce`` at the start
            (see :class:`SparseTrainConfig`), unless ``allow_slack_constraint``.
        ArgumentError: ``config`` not a :class:`SparseTrainConfig` or a field out of its rule
            (:meth:`SparseTrainConfig.validate`, run again here); a BOS id outside the vocabulary
            (:func:`resolve_bos_id`), training token ids outside it; ``train_ids`` neither a ``TokenDataset`` nor a
            1-D integer tensor.
        ImportError: ``lora_rank`` without ``peft``.
    """

    def __init__(self, model: Any, train_ids: Int[torch.Tensor, " n"] | TokenDataset, config: SparseTrainConfig,
                 augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None) -> None:
        if not isinstance(config, SparseTrainConfig):
            raise ArgumentError(f"SparseAttentionTrainer: config must be a SparseTrainConfig, got "
                                f"{type(config).__name__}")
        config.validate()  # again: a field may have been set after construction
        self.config = config
        self.augment = augment
        self.bos_id = resolve_bos_id(model, config.bos_id)
        self.hf = hf_module(model)
        self.dataset, self.train_ids = self._training_windows(model, train_ids)
        torch.manual_seed(config.seed)
        self.peft_model, self.param_names, self.optimizer = self._trainable()
        self.gen = torch.Generator(device="cpu").manual_seed(config.seed)  # data draws: CPU, the same on every device
        self.step = 0
        self.history: list[StepRecord] = []
        with _dense_gates(self.hf):  # the base model's CE: every edge open (eval mode closes those with logit <= 0)
            self.base_ce = self.measure_train_ce(config.target_batches)
        target = (self.base_ce if config.target_ce is None else config.target_ce) - config.target_margin
        self._check_slack(target)
        self.geco = GECO(target, lr=config.geco_lr, ema=config.geco_ema, init_lambda=config.init_lambda,
                         min_lambda=config.min_lambda, max_lambda=config.max_lambda)

    def _training_windows(self, model: Any, train_ids: torch.Tensor | TokenDataset
                          ) -> tuple[TokenDataset | None, torch.Tensor]:
        """``(dataset or None, its tokens or the 1-D stream)``, checked against the config and the model
        (see the class's Raises)."""
        cfg = self.config
        check_windows_kind(train_ids, "SparseAttentionTrainer", "train_ids")
        if isinstance(train_ids, TokenDataset):
            if train_ids.seq_len != cfg.seq_len:
                raise GateConfigError(f"the training dataset's windows have {train_ids.seq_len} tokens, "
                                      f"config.seq_len is {cfg.seq_len}: make them equal")
            bad = (train_ids.tokens[:, 0] != self.bos_id).nonzero().flatten()
            if bad.numel():
                first = int(bad[0])
                raise GateConfigError(f"training window {first} starts with id {int(train_ids.tokens[first, 0])}, "
                                      f"not the model's BOS id {self.bos_id} ({bad.numel()} such windows): build the "
                                      "dataset with the model's BOS (TokenDataset.from_documents(..., config=...))")
            check_token_ids(train_ids.tokens, model, "train_sparse_attention: the training windows")
            return train_ids, train_ids.tokens
        stream = train_ids.long().flatten()
        if stream.numel() < cfg.seq_len:
            raise GateConfigError(f"training stream has {stream.numel()} tokens < seq_len {cfg.seq_len}")
        check_token_ids(stream, model, "train_sparse_attention: the training stream", length=cfg.seq_len)
        check_one_text(model, stream)
        return None, stream

    def _trainable(self) -> tuple[Any, list[str], torch.optim.Optimizer]:
        """Install the gates (unless present; ``gated`` mode), wrap LoRA if asked; return ``(peft model or
        None, names of the trainable parameters, AdamW)`` (the gate biases in their own group, ``gate_lr``)."""
        cfg = self.config
        try:
            get_gates(self.hf)
        except GateNotInstalledError:
            install_gated_attention(self.hf, init_bias=cfg.init_bias, temperature=cfg.temperature)
        set_gate_mode(self.hf, "gated")
        peft_model: Any = None
        if cfg.lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            peft_model = get_peft_model(self.hf, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                            target_modules="all-linear", lora_dropout=0.0))
        gate_params = [g.bias for g in get_gates(self.hf).values()]
        for p in gate_params:
            p.requires_grad_(True)
        gate_ids = {id(p) for p in gate_params}
        names = [n for n, p in self.hf.named_parameters() if p.requires_grad]
        others = [p for _, p in self.hf.named_parameters() if p.requires_grad and id(p) not in gate_ids]
        # fp16 / bf16 parameters train through fp32 master copies (mixed precision): AdamW in fp16 underflows
        # (1 − β2)·g² and eps = 1e-8 to 0, and its first step turns every weight into 0 / 0 = NaN; in bf16 an
        # update below half a step of a weight rounds away
        self.masters = MasterWeights([*others, *gate_params])
        optimizer = torch.optim.AdamW(
            [{"params": self.masters.optimized(others), "lr": cfg.lr, "weight_decay": cfg.weight_decay},
             {"params": self.masters.optimized(gate_params), "lr": cfg.gate_lr, "weight_decay": 0.0}],
            betas=cfg.betas)
        return peft_model, names, optimizer

    def _check_slack(self, target: float) -> None:
        """Raise (or warn) when the constraint ``CE <= target`` holds from step 0 by a vacuous margin."""
        cfg = self.config
        slack = target - self.base_ce
        if slack <= cfg.max_initial_slack * self.base_ce:
            return
        msg = (f"the constraint CE <= {target:.4f} (τ − target_margin) is slack by {slack:.4f} nats at step 0: "
               f"the base model's CE on the training windows is {self.base_ce:.4f}, more than max_initial_slack="
               f"{cfg.max_initial_slack} of it below τ, so the gates would close with no check on CE. Measure τ "
               "on the same windows as the training (target_ce=None does) — for a corpus of documents, windows at "
               "document starts (TokenDataset.from_documents) — or set allow_slack_constraint=True if the loose "
               "τ is intended")
        if not cfg.allow_slack_constraint:
            raise VacuousConstraintError(msg)
        warnings.warn(msg, stacklevel=3)

    def _batch(self, index: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(windows, target_mask or None)`` of training batch ``index``: the dataset's batch ``index``,
        or random stream windows drawn from ``gen``; ``augment`` applied (drawing from ``gen``)."""
        cfg = self.config
        mask = None
        if self.dataset is not None:
            x = self.dataset.batch(index, cfg.batch_size, cfg.seed)
            mask = self.dataset.batch_targets(index, cfg.batch_size, cfg.seed)
        else:
            x = TokenDataset.sample_stream(self.train_ids, cfg.batch_size, cfg.seq_len, gen, self.bos_id)
        if self.augment is not None:
            x = self.augment(x, gen)
        return x.to(self._device), mask

    @torch.no_grad()
    def measure_train_ce(self, n_batches: int) -> float:
        """CE (nats per counted prediction) of the current model on ``n_batches`` training batches,
        eval mode: the dataset's first ``n_batches`` batches (those steps ``0 … n_batches−1`` train on,
        counting its ``target_mask``), or stream windows from a generator of its own (seed
        ``config.seed + 1``, so the training batches are unaffected).

        Raises:
            ArgumentError: ``n_batches`` not an int ≥ 1 (0 or a negative count measured one batch).
            GateConfigError: the batches hold no counted prediction.
        """
        check_int("SparseAttentionTrainer.measure_train_ce", "n_batches", n_batches)
        gen = torch.Generator(device="cpu").manual_seed(self.config.seed + 1)
        was = self.hf.training
        self.hf.eval()
        total, count = 0.0, 0
        try:  # the model's mode comes back also when a batch fails (a CUDA OOM, Ctrl-C)
            for i in range(n_batches):
                x, mask = self._batch(i, gen)
                ce, n = next_token_ce(self.hf(input_ids=x).logits, x, mask)
                total, count = total + ce.item(), count + n
        finally:
            self.hf.train(was)
        if count == 0:
            raise GateConfigError("the training windows have no counted prediction (target_mask)")
        return total / count

    def _rng_states(self) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The random states a step draws from: torch's global one, the data generator's, each CUDA device's."""
        return (torch.get_rng_state(), self.gen.get_state(),
                {i: torch.cuda.get_rng_state(i) for i in self._cuda_devices()})

    def _set_rng_states(self, states: tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]) -> None:
        torch.set_rng_state(states[0])
        self.gen.set_state(states[1])
        for i, state in states[2].items():
            torch.cuda.set_rng_state(state, i)

    @property
    def _device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def _cuda_devices(self) -> list[int]:
        """Indices of the CUDA devices the model's parameters are on (their RNG states go in checkpoints)."""
        return sorted({p.device.index or 0 for p in self.hf.parameters() if p.device.type == "cuda"})

    def train_step(self) -> StepRecord:
        """One optimiser step on the Lagrangian and one GECO step; returns its :class:`StepRecord`.

        Raises:
            NonFiniteError: the loss or the gradient norm is NaN / inf (e.g. a far too large ``lr`` or a NaN in
                the model); nothing was updated (weights, gates, Adam state, GECO's λ, the step count, the random
                states), so the trainer and a checkpoint on disk hold the last good state. Any other exception
                before the optimizer's update (a CUDA out-of-memory error, ``Ctrl-C``) passes through and leaves the
                trainer so too: calling :meth:`train_step` again runs the step as an uninterrupted run would.
        """
        cfg = self.config
        self.hf.train()
        # the shared WSD line without warmup, to 10% on the last step (until 2026-11-29 one step late: the first
        # step of the decay at 100%, the last at 1 − 0.9·(n−1)/n)
        factor = wsd_lr_factor(self.step, cfg.total_steps, warmup_frac=0.0, decay_frac=cfg.decay_frac, min_factor=0.1)
        for group, base in zip(self.optimizer.param_groups, (cfg.lr, cfg.gate_lr), strict=True):
            group["lr"] = base * factor
        recovering = cfg.recover_fraction > 0 and self.step >= cfg.total_steps * (1.0 - cfg.recover_fraction)
        if recovering:
            for gate in get_gates(self.hf).values():
                gate.eval()
        rng = self._rng_states()  # what the batch (stream windows) and the gates' noise draw from
        try:
            x, mask = self._batch(self.step, self.gen)
            with counting_positions(self.hf, real_positions(mask)):  # right padding: not in the sparsity term
                logits = self.hf(input_ids=x).logits
            ce_sum, n = next_token_ce(logits, x, mask)
            ce = ce_sum / max(n, 1)
            density = expected_edge_fraction(self.hf).to(ce.device)
            loss = ce if recovering else density + self.geco.lam * (ce - self.geco.target)
            self.optimizer.zero_grad(set_to_none=True)
            if not bool(torch.isfinite(loss.detach())):  # before any gradient: the weights stay the last good ones
                raise NonFiniteError(f"sparse-attention training: step {self.step}: the loss is {float(loss):.4g} "
                                     f"(CE {float(ce):.4g}); the model and gates are as before this step",
                                     step=self.step, tensor="loss")
            loss.backward()
            self.masters.move_grads()  # a low-precision parameter's gradient goes to its fp32 master
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            if not bool(torch.isfinite(norm)):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"sparse-attention training: step {self.step}: the gradient norm is "
                                     f"{float(norm):.4g}; the model and gates are as before this step",
                                     step=self.step, tensor="grad")
        except BaseException:  # a non-finite value, a CUDA OOM, Ctrl-C before the update: as after step - 1,
            self.optimizer.zero_grad(set_to_none=True)  # the random states too (the retry draws what this step drew)
            self._set_rng_states(rng)
            raise
        self.optimizer.step()
        self.masters.round_()  # the model's low-precision weights: the updated masters, rounded once
        lam = self.geco.update(ce.item())
        stats = edge_statistics(self.hf)
        self.step += 1
        rec = StepRecord(self.step, ce.item(), lam, float(density.detach()), stats.active_fraction)
        self.history.append(rec)
        return rec

    def train(self, steps: int | None = None, progress: bool = True, checkpoint_dir: str | Path | None = None,
              checkpoint_every: int | None = None) -> list[StepRecord]:
        """Run up to ``steps`` more steps (default: until ``config.total_steps``) with a tqdm bar (CE, λ, active edges),
        never past ``config.total_steps``, as :meth:`~nnsight_lorsa.training.Trainer.train`: the LR decay and the
        recovery phase are laid out over ``total_steps`` (until 2026-11-29 a call past it kept training at the
        recovery phase's LR; raise ``total_steps`` to train longer).

        With ``checkpoint_dir``, a checkpoint is written every ``checkpoint_every`` steps and at the end.

        Raises:
            ArgumentError: before the first step: ``steps`` not None or an int ≥ 0 (``2.5`` ran 3 steps, ``-1``
                none and saved), ``checkpoint_every`` not None or an int ≥ 0, or > 0 without ``checkpoint_dir``,
                ``checkpoint_dir`` not None, a str or ``os.PathLike``, ``progress`` not a bool.
        """
        if steps is not None:
            check_int("SparseAttentionTrainer.train", "steps", steps, least=0)
        check_checkpointing(checkpoint_dir, checkpoint_every, "SparseAttentionTrainer.train")
        check_flag(progress, "progress", "SparseAttentionTrainer.train")
        end = self.config.total_steps if steps is None else min(self.config.total_steps, self.step + steps)
        bar = tqdm(total=end - self.step, desc="sparse attention", disable=not progress, dynamic_ncols=True)
        while self.step < end:
            rec = self.train_step()
            bar.update(1)
            bar.set_postfix(ce=f"{rec.ce:.3f}", lam=f"{rec.lam:.3g}", active=f"{rec.active_fraction:.3%}")
            if checkpoint_dir is not None and checkpoint_every and self.step % checkpoint_every == 0:
                self.save_checkpoint(checkpoint_dir)
        bar.close()
        if checkpoint_dir is not None:
            self.save_checkpoint(checkpoint_dir)
        return self.history

    # ---- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write ``checkpoint.safetensors`` (parameters, AdamW state, RNG states) + ``checkpoint.json`` +
        ``manifest.json`` (sizes, sha256) atomically (:func:`~..training.checkpoint_io.write_checkpoint`:
        the previous checkpoint at ``directory`` stays until the new one is complete).

        Raises:
            CheckpointError: ``directory`` exists and is neither empty nor a checkpoint.
        """
        directory = Path(directory)
        params = dict(self.hf.named_parameters())
        # a low-precision parameter's fp32 master is what the training holds (the model has its rounding): save it
        held = {n: self.masters.held(params[n]) for n in self.param_names}
        tensors: dict[str, torch.Tensor] = {f"param.{n}": held[n].detach().cpu().contiguous()
                                            for n in self.param_names}
        opt = self.optimizer.state_dict()
        for idx, st in opt["state"].items():
            for key, val in st.items():
                tensors[f"optim.{idx}.{key}"] = torch.as_tensor(val, device="cpu").detach().contiguous()
        tensors["rng.global"] = torch.get_rng_state()
        tensors["rng.data"] = self.gen.get_state()
        for index in self._cuda_devices():  # the gates draw their training noise on their own device
            tensors[f"rng.cuda.{index}"] = torch.cuda.get_rng_state(index)
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in opt["param_groups"]]
        meta = {"step": self.step, "config": asdict(self.config), "geco": self.geco.state_dict(),
                "param_names": self.param_names, "param_groups": groups,
                "optim_keys": {str(i): sorted(st) for i, st in opt["state"].items()},
                "history": [asdict(r) for r in self.history]}
        write_checkpoint(directory, {CHECKPOINT_TENSORS: tensors,
                                     CHECKPOINT_JSON: (json.dumps(meta) + "\n").encode()})
        return directory

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a :meth:`save_checkpoint` directory into this trainer (same model and config).

        Every file is first checked against ``manifest.json`` (``<directory>.old`` is used when
        ``directory`` is missing: a save interrupted between its renames).

        Raises:
            CheckpointError: no checkpoint there; the manifest missing or corrupt (also a checkpoint
                written before manifests existed); a file missing, truncated or altered (named);
                parameter names / entries that do not match this trainer's; or a checkpoint saved under another
                :class:`SparseTrainConfig` (the settings named; only ``total_steps`` may differ). Nothing is set
                before everything is checked.
        """
        d, _ = verified_checkpoint(directory, (CHECKPOINT_TENSORS, CHECKPOINT_JSON))
        tpath, jpath = d / CHECKPOINT_TENSORS, d / CHECKPOINT_JSON
        try:
            meta = json.loads(jpath.read_text(encoding="utf-8"))
            names = meta["param_names"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{jpath}: malformed ({e!r})") from e
        if names != self.param_names:
            raise CheckpointError(f"{jpath}: checkpoint parameters do not match the trainer's (LoRA vs full?)")
        self._check_saved_config(meta.get("config"), jpath)
        tensors = load_file(str(tpath))
        params = dict(self.hf.named_parameters())
        # everything checked before anything is set: until 2026-11-28 a bad entry left the trainer partly restored
        # (parameters, RNG states), a wrong-shape moment loaded and failed at the next step, an int parameter or
        # moment, an unknown tensor and a negative or fractional step were taken silently
        try:
            step = meta["step"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise CheckpointError(f"key 'step' must be an int >= 0, got {step!r}")
            optimized = [p for g in self.optimizer.param_groups for p in g["params"]]
            known = {f"param.{n}" for n in self.param_names} | {"rng.global", "rng.data"}
            for n in self.param_names:
                _check_saved(tensors[f"param.{n}"], f"param.{n}", tuple(params[n].shape))
            state = {}
            for i, keys in meta["optim_keys"].items():
                state[int(i)] = {k: tensors[f"optim.{i}.{k}"] for k in keys}
                shape = tuple(optimized[int(i)].shape)
                for k in keys:
                    known.add(f"optim.{i}.{k}")
                    _check_saved(state[int(i)][k], f"optim.{i}.{k}", () if k == "step" else shape)
            for name, like in (("rng.global", torch.get_rng_state()), ("rng.data", self.gen.get_state())):
                if tensors[name].dtype != like.dtype or tensors[name].shape != like.shape:
                    raise CheckpointError(f"{name} is {tensors[name].dtype} {tuple(tensors[name].shape)}, a "
                                          f"generator's state is {like.dtype} {tuple(like.shape)}")
            unknown = sorted(k for k in tensors if k not in known and not k.startswith("rng.cuda."))
            if unknown:
                raise CheckpointError(f"unknown tensors {unknown}")
            geco = copy.deepcopy(self.geco)  # checked on a copy: GECO.load_state_dict raises before setting anything
            geco.load_state_dict(meta["geco"])
            history = [StepRecord(**r) for r in meta["history"]]
            groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
            # the optimizer checks its groups before it sets anything: first, so that its refusal leaves all as it was
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, GateConfigError) as e:
            raise CheckpointError(f"{d}: checkpoint does not fit this trainer ({e!r})") from e
        with torch.no_grad():
            for n in self.param_names:  # a master as saved, its low-precision parameter the rounding
                self.masters.set_(params[n], tensors[f"param.{n}"])
        torch.set_rng_state(tensors["rng.global"])
        self.gen.set_state(tensors["rng.data"])
        for index in self._cuda_devices():
            if f"rng.cuda.{index}" in tensors:
                torch.cuda.set_rng_state(tensors[f"rng.cuda.{index}"], index)
        self.geco = geco
        self.step = step
        self.history = history

    def _check_saved_config(self, saved: Any, jpath: Path) -> None:
        """Refuse a checkpoint saved under another :class:`SparseTrainConfig`: a resume continues the run it was saved
        from (until 2026-11-28 a trainer built with, say, another ``target_ce``, ``init_bias`` or ``geco_lr`` took the
        saved weights, moments and λ and trained on under its own settings, a run neither config describes, without
        a word). ``total_steps`` may differ (a run extended or cut short; with ``decay_frac`` or ``recover_fraction``
        the schedule then follows the new count), and ``allow_slack_constraint`` (a start-up check's switch); a field
        the checkpoint does not hold (saved before the field existed) is not compared."""
        if not isinstance(saved, dict):
            raise CheckpointError(f"{jpath}: key 'config' must be the saved SparseTrainConfig, got {saved!r}")
        mine = json.loads(json.dumps(asdict(self.config)))  # as saved: tuples as lists
        differ = [f"{k}={saved[k]!r} (this trainer: {mine[k]!r})" for k in mine
                  if k in saved and k not in ("total_steps", "allow_slack_constraint") and saved[k] != mine[k]]
        if differ:
            raise CheckpointError(f"{jpath}: saved under another SparseTrainConfig: {'; '.join(differ)}. A checkpoint "
                                  "resumes the run it was saved from: build the trainer with the saved settings "
                                  "(the file's \"config\"; only total_steps may change)")

    def finished_model(self) -> Any:
        """The trained transformers model with gates, in eval mode (LoRA merged into the weights)."""
        if self.peft_model is not None:
            self.hf = self.peft_model.merge_and_unload()
            self.peft_model = None
        return self.hf.eval()


@dataclass
class TrainingSummary:
    """What :func:`train_sparse_attention` measured (CE in nats/token, fractions of allowed edges)."""

    target_ce: float
    base_ce: float
    steps: int
    wall_seconds: float
    history: list[StepRecord] = field(default_factory=list)
    #: with ``heldout``: the held-out CE before training (gates open) and after (eval mode), and whether the
    #: trained model breaks the constraint there: ``heldout_ce > heldout_base_ce + (τ − base_ce) + tolerance``
    heldout_base_ce: float | None = None
    heldout_ce: float | None = None
    heldout_violation: bool | None = None


def train_sparse_attention(model: Any, train_ids: Int[torch.Tensor, " n"] | TokenDataset, config: SparseTrainConfig,
                           progress: bool = True, checkpoint_dir: str | Path | None = None,
                           checkpoint_every: int | None = None, heldout: Any = None,
                           heldout_tolerance: float = 0.05) -> tuple[Any, TrainingSummary]:
    """Post-train ``model`` to sparse attention (Draye et al. 2025 §3.2); returns ``(model, summary)``.

    ``train_ids``: a :class:`~..training.dataset.TokenDataset` or a 1-D stream, as
    :class:`SparseAttentionTrainer`. Resumes from ``checkpoint_dir`` if it is a non-empty directory
    (a checkpoint that fails verification raises :class:`~..errors.CheckpointError`). The returned model is the trained
    transformers model with gates, in eval mode (LoRA merged).

    ``heldout``: held-out windows (a ``TokenDataset`` or a stream, as :func:`evaluate_sparse`). Their CE is
    measured before training (gates as installed, all open) and after, reported in the summary, and
    checked against the constraint carried over to them: the trained model may lose at most
    ``τ − base_ce`` (the training constraint's own allowance) plus ``heldout_tolerance`` nats there.
    Training CE alone cannot show a model that fits its training windows and lost the rest (a probe:
    training CE within τ, held-out 3.00 → 3.70). A violation is not silent: :class:`HeldoutConstraintWarning`
    names both numbers, and ``summary.heldout_violation`` is True.

    Raises:
        ArgumentError: ``heldout_tolerance`` not a finite number ``>= 0``, ``heldout`` not a ``TokenDataset`` or a
            1-D token stream (:func:`evaluate_sparse`, before training); the trainer's errors
            (:class:`SparseAttentionTrainer`, :meth:`SparseAttentionTrainer.train`).

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §3.2 (constrained
    optimisation).
    """
    check_checkpointing(checkpoint_dir, checkpoint_every, "train_sparse_attention")  # before the model is touched
    check_real("train_sparse_attention", "heldout_tolerance", heldout_tolerance)
    t0 = time.perf_counter()
    trainer = SparseAttentionTrainer(model, train_ids, config)
    if checkpoint_dir is not None and checkpoint_exists(checkpoint_dir):
        trainer.load_checkpoint(checkpoint_dir)
    before = None
    if heldout is not None:
        with _dense_gates(trainer.hf):  # the base model's held-out CE, every edge open
            before = float(evaluate_sparse(trainer.hf, heldout, seq_len=config.seq_len, bos_id=trainer.bos_id)["ce"])
    trainer.train(progress=progress, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every)
    summary = TrainingSummary(trainer.geco.target, trainer.base_ce, trainer.step, time.perf_counter() - t0,
                              trainer.history)
    finished = trainer.finished_model()
    if heldout is not None and before is not None:
        after = float(evaluate_sparse(finished, heldout, seq_len=config.seq_len, bos_id=trainer.bos_id)["ce"])
        allowance = max(trainer.geco.target - trainer.base_ce, 0.0)
        allowed = before + allowance + heldout_tolerance
        summary.heldout_base_ce, summary.heldout_ce, summary.heldout_violation = before, after, after > allowed
        if after > allowed:
            warnings.warn(HeldoutConstraintWarning(
                f"held-out CE {before:.4f} -> {after:.4f} nats: above the constraint carried over to the held-out "
                f"windows ({allowed:.4f} = base {before:.4f} + allowance {allowance:.4f} + tolerance "
                f"{heldout_tolerance}); the training CE met τ, the held-out text did not — train on windows like "
                "the held-out ones (TokenDataset.from_documents for documents), or tighten target_margin"),
                stacklevel=2)
    return finished, summary


def _check_saved(value: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    """A checkpoint tensor of a parameter or its AdamW state: float, ``shape``, finite (the values a save writes).

    Raises:
        CheckpointError: it is not (:meth:`SparseAttentionTrainer.load_checkpoint` names the file)."""
    if not value.is_floating_point() or tuple(value.shape) != shape:
        raise CheckpointError(f"{name} is {value.dtype} {tuple(value.shape)}, expected a float {shape}")
    if count_non_finite(value):
        raise CheckpointError(f"{name} holds non-finite values")
