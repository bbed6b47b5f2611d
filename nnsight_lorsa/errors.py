"""Exceptions raised by nnsight-lorsa.

Every error names the problem (the key, the shape, the layer, the architecture) so that a
caller can fix its input; nothing is half-applied when one is raised.
"""

from __future__ import annotations


class LorsaError(Exception):
    """Base class of every exception raised by this package.

    Source: ours (this package's named errors).
    """


class ShapeError(LorsaError, ValueError):
    """A tensor has the wrong shape or dtype for the module it is given to (e.g. wrong d_model).

    Source: ours (this package's named errors).
    """


class LayerOutOfRangeError(LorsaError, IndexError):
    """A layer index is outside ``[0, n_layers)`` of the model, or no replacement exists for it.

    Source: ours (this package's named errors).
    """


class UnsupportedArchitectureError(LorsaError, NotImplementedError):
    """The model family has no adapter, or lacks a piece an adapter needs (named in the message).

    Source: ours (this package's named errors).
    """


class CheckpointError(LorsaError, ValueError):
    """A checkpoint is malformed (missing file, missing/unknown tensor, wrong shape, bad config).

    Source: ours (this package's named errors).
    """


class ConfigMismatchError(LorsaError, ValueError):
    """A replacement module does not fit the model it is attached to (d_model, head_dim, layer).

    Source: ours (this package's named errors).
    """


class MemoryBudgetError(ConfigMismatchError):
    """An attribution cannot fit the memory budget it was given (``attribute(..., max_memory=...)``).

    Source: ours (this package's named errors).
    """


class DenseAdjacencyError(LorsaError, RuntimeError):
    """``Graph.adjacency`` was read on a graph that keeps only its causal blocks: the dense ``n_nodes²``
    matrix is built by the explicit ``graph.densify()`` (the message says how large it is).

    Source: ours (this package's named errors).
    """


class PlacementError(ConfigMismatchError):
    """A module or tensor is on a device (or in a dtype) where the computation cannot run: e.g. a
    replacement whose weights were never materialised (``meta``) spliced into a model on CUDA, or
    tensors of one call on two devices; the message names which module or tensor is where.

    Source: ours (this package's named errors).
    """


class ArgumentError(LorsaError, TypeError, ValueError):
    """A public function was given an argument of the wrong type or an empty / meaningless value
    (e.g. ``replace(layer=2.0)``, ``replace(layer=[])``); the message names the argument.

    Source: ours (this package's named errors).
    """


class TraceOrderError(LorsaError, RuntimeError):
    """A replacement was requested after the model already ran past the site it replaces.

    Source: ours (this package's named errors).
    """


class NotReadyError(LorsaError, RuntimeError):
    """A step was asked for before the step it needs ran: a training objective's scale factors before they
    were estimated (``Trainer.estimate_norms`` / the first ``train_step``), a
    :class:`~nnsight_lorsa.training.distributed.DataParallel` before ``torch.distributed.init_process_group``,
    an attribution's targets before its frozen forward reached the unembedding. The message names the step
    to run first. Still a ``RuntimeError`` for callers that catch those.

    Source: ours (this package's named errors).
    """


class UnsupportedGenerationError(TraceOrderError):
    """A replacement cannot follow this generation (e.g. a Lorsa under beam search); raised before
    a token is returned, never a silently unreplaced one. The message names what to use instead.

    Source: ours (this package's named errors).
    """


class InvokeRowsError(TraceOrderError):
    """A replacement spliced from some ``tracer.invoke`` blocks of a trace (it replaces their rows only) was read
    or edited from an invoke whose rows it does not replace -- its internals there are computed for no row the
    model uses; or the site's output does not hold the batch's rows first, so they cannot be told apart. The
    message names the site, the rows replaced and the rows asked for, and the fix: call ``replace()`` in that
    invoke too, or once in an empty ``tracer.invoke()`` (the whole batch).

    Source: ours (this package's named errors).
    """


class ConcurrentTraceError(TraceOrderError):
    """Two threads traced one nnsight model at the same time. nnsight runs a trace's intervention code
    in greenlets bound to the thread that started it and keeps one interleaver per model, so traces of
    one model are per-thread: run them one after another (a lock around the ``with`` block) or give
    each thread its own model object (nnsight docs: one trace at a time per model).

    Source: ours (this package's named errors).
    """


class MissingTokenizerError(LorsaError, ValueError):
    """Text was given where the model has no tokenizer (a model directory without tokenizer files), or
    its tokenizer files cannot be loaded; the message says what is missing. Token ids work without one.

    Source: ours (this package's named errors).
    """


class ActivationCacheError(CheckpointError):
    """An on-disk activation cache is malformed or does not match what it is used for (model, site, width).

    Source: ours (this package's named errors).
    """


class FormatDetectionError(CheckpointError):
    """No checkpoint format, or more than one, matches the files at a path (the message lists the
    formats, the files each looks for, and what the path holds); pass ``format=`` to choose one.

    Source: ours (this package's named errors).
    """


class NonFiniteError(LorsaError, FloatingPointError):
    """Training met a non-finite value — the loss, a gradient, the learning rate or a dataset-norm scale
    factor — and stopped before it reached the weights; or an evaluation's metric was NaN / inf (non-finite
    logits, :func:`~nnsight_lorsa.training.evaluate`: :attr:`step` is the batch, :attr:`tensor` the metric), or
    the logits an attribution starts from were (:func:`~nnsight_lorsa.attribution.attribute`, ``tensor="logits"``),
    or its edge rows (``tensor="edges"``, before anything of the batch is stored, on every storage path: stored
    sparse they would have been dropped from the rows, in the full graph's blocks or a dense matrix kept as NaN edges),
    or a patching experiment's metric was (:mod:`~nnsight_lorsa.patching`, ``tensor="metric"``), or a graph's edges or
    logit probabilities are, where :func:`~nnsight_lorsa.attribution.prune` or the export reads them (a graph built
    by hand: ``tensor="edges"`` / ``"logit_probs"``).
    The message names the step and the tensor (:attr:`step`, :attr:`tensor`); the trainer holds the state as
    it was before that step (weights, Adam state, dead counters, step), so nothing is lost and a checkpoint on
    disk is the last good one.

    Source: ours (this package's named errors).
    """

    def __init__(self, message: str, *, step: int | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        #: the trainer's step at the failure (the batch index it was training on)
        self.step = step
        #: what was non-finite: ``"loss"``, ``"grad"``, ``"lr"``, ``"s_in"``, ``"s_out"``, …
        self.tensor = tensor


class RankFailedError(LorsaError, RuntimeError):
    """Another rank of a data-parallel run (:class:`~nnsight_lorsa.training.distributed.DataParallel`) failed at
    this step: its source raised while getting its part of the batch, or its forward pass (the module, the
    objective, the loss) raised (that rank raises its own error). Every rank stops at the same step, before any
    collective of the step would wait for the failed one (the backward's gradient all-reduce included); the message
    names the failed ranks and the step (:attr:`ranks`, :attr:`step`). A rank whose backward pass raised (an autograd
    hook or function) is named too, once its process has exited or destroyed its group (the others wait in the
    gradient all-reduce until then; raised from gloo's error).

    Source: ours (this package's named errors).
    """

    def __init__(self, message: str, *, step: int, ranks: list[int]) -> None:
        super().__init__(message)
        #: the step the ranks failed at
        self.step = step
        #: the failed ranks (in the process group)
        self.ranks = ranks


class TooFewTokensError(LorsaError, ValueError):
    """A batch has too few counted tokens (``loss_mask`` True) for what training does with it: none in
    the batches the scale factors are estimated on, or (the Lorsa recipe's OV initialisation) fewer than
    ``d_qk_head`` in its first batch. Raised before the first step; the message says what to change. Also
    raised by :class:`~nnsight_lorsa.training.TokenDataset`'s constructors when a text holds fewer tokens
    than one window, or no document holds a token.

    Source: ours (this package's named errors).
    """


class GateConfigError(LorsaError, ValueError):
    """A sparse-attention setting is invalid: a gate's (unknown mode, non-positive temperature, ``top_k < 1``,
    head count), the GECO multiplier's, or the training windows' (a stream holding the model's EOS id, windows
    not starting with its BOS, no BOS id); the message names the setting and what to pass instead.

    Source: ours (this package's named errors).
    """


class VacuousConstraintError(GateConfigError):
    """The sparse-attention constraint ``CE <= τ`` holds from step 0 by a vacuous margin: the base
    model's CE on the training windows is more than ``max_initial_slack`` of it below τ (e.g. τ measured
    on other windows), so training would close gates with no check on CE.

    Source: ours (this package's named errors).
    """


class GateNotInstalledError(LorsaError, RuntimeError):
    """Gated attention ran (or was queried) on an attention module that carries no ``gate``
    (:func:`~nnsight_lorsa.sparse_attention.install_gated_attention` adds one).

    Source: ours (this package's named errors).
    """


class HeldoutConstraintWarning(UserWarning):
    """A sparse-attention model met its CE constraint on the training windows but not on held-out ones
    (``train_sparse_attention(..., heldout=...)``; the summary's ``heldout_violation``).

    Source: ours (this package's named errors).
    """


class MissingDependencyError(LorsaError, ImportError):
    """What was asked needs an optional package that is not installed (W&B logging needs ``wandb``, the
    Hub needs ``huggingface_hub``); the message names the package and the install command
    (``pip install nnsight-lorsa[wandb]``).

    Source: ours (this package's named errors).
    """


class ServerVersionError(LorsaError, RuntimeError):
    """The remote server runs another nnsight version than this client, or another Python (read from its
    ``GET /env`` before a request is sent; :mod:`nnsight_lorsa.server_version`). The message names both and what to
    do.

    Attributes:
        host: the server's address.
        client_version, server_version: the two nnsight versions (``"Python 3.11"`` / ``"Python 3.12"`` where the
            Pythons differ).

    Source: ours (this package's named errors).
    """

    def __init__(self, message: str, host: str, client_version: str, server_version: str) -> None:
        super().__init__(message)
        self.host, self.client_version, self.server_version = host, client_version, server_version


class ServerVersionWarning(UserWarning):
    """The remote server did not say which nnsight it runs (no ``GET /env``, or no ``nnsight`` in it): the
    request is sent unchecked.

    Source: ours (this package's named errors).
    """


class SaveError(LorsaError, OSError):
    """A save failed while writing its files (disk full, permission, an I/O error: the ``OSError`` is the
    ``__cause__``). Every writer stages its files beside the target directory and swaps them in only when all
    are written (:func:`nnsight_lorsa._atomic.atomic_directory`), so the previous files at the path are intact
    and nothing was lost; the message names the directory. Still an ``OSError`` for callers that catch those.

    Source: ours (this package's named errors).
    """


class UndefinedNormalizationError(LorsaError, ZeroDivisionError):
    """A normalized patching effect divides by ``clean − corrupt`` where the clean and corrupt metrics are equal or
    within the logits' rounding (``PatchingResult.normalized``, ``PathPatchingResult.normalized``; so do
    ``circuit_size``'s ``m_all − m_0`` and ``relative_effect``'s baseline, ``patching.metrics.check_gap``): the
    message names the rows and both metrics.

    Source: ours (this package's named errors).
    """


__all__ = ["ActivationCacheError", "ArgumentError", "CheckpointError", "ConcurrentTraceError", "ConfigMismatchError",
           "DenseAdjacencyError", "FormatDetectionError", "GateConfigError", "GateNotInstalledError",
           "HeldoutConstraintWarning", "InvokeRowsError", "LayerOutOfRangeError", "LorsaError", "MemoryBudgetError",
           "MissingDependencyError", "MissingTokenizerError", "NonFiniteError", "NotReadyError", "PlacementError",
           "RankFailedError",
           "SaveError",
           "ServerVersionError", "ServerVersionWarning", "ShapeError",
           "TooFewTokensError", "TraceOrderError", "UndefinedNormalizationError", "UnsupportedArchitectureError",
           "UnsupportedGenerationError", "VacuousConstraintError"]
