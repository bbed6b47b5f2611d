"""What SAEs, transcoders and cross-layer transcoders share: config, encoder, decoder, hook points.

A *sparse coder* reads ``x: (*batch, d_in)``, computes feature activations

    acts_pre = x W_enc + b_enc            (*batch, d_sae)
    acts     = σ(acts_pre)                σ from :mod:`.activations` (ReLU, TopK, BatchTopK, JumpReLU)

and writes ``acts W_dec + b_dec: (*batch, d_out)`` (Bricken et al. 2023, *Towards Monosemanticity* with SAELens v6
names and
layouts: ``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``, ``W_dec (d_sae, d_out)``, ``b_dec (d_out,)``;
row ``i`` of ``W_dec`` is feature ``i``'s direction). :class:`SparseCoder` is the base of
:class:`~.sae.SparseAutoencoder` (``d_out = d_in``, optional ``b_dec`` centering) and of
:class:`~.transcoder.Transcoder` / :class:`~.transcoder.SkipTranscoder`; :func:`encode_and_pre_with` and
:func:`affine` are the same steps for each layer of a :class:`~.clt.CrossLayerTranscoder`.

Values pass through :class:`HookPoint` children — ``hook_sae_acts_pre``, ``hook_sae_acts_post``
(the features), ``hook_sae_recons`` (the output) and ``hook_error`` (the error term when spliced
into a model with ``error=True``) — so that attached to an nnsight model each is an envoy.
Needs torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .._checks import check_instance
from .._repr import FieldsRepr
from .._typing import Float
from ..errors import CheckpointError, ShapeError
from .activations import ACTIVATIONS, BatchTopK, JumpReLU, check_activation_params, make_activation
from .hook_point import HookPoint
from .replacement_module import ReplacementModule, check_construction
from .sparse_decode import SparseActs, gathered_preact, sparse_decode


@dataclass(repr=False)
class SparseCoderConfig(FieldsRepr):
    """Shape and activation of a sparse coder (fields common to SAEs, transcoders and CLTs).

    Attributes:
        d_in: width of the input (the model's ``d_model`` at the site read).
        d_sae: number of features (per layer for a CLT).
        activation: ``"relu"``, ``"topk"``, ``"batchtopk"``, ``"jumprelu"``, ``"abstopk"`` or
            ``"groupmax"`` (:mod:`.activations`).
        activation_params: its parameters, e.g. ``{"k": 32}`` or ``{"bandwidth": 0.001}``.
        extra: free-form metadata (training metrics, provenance).

    Raises:
        CheckpointError: a size that is not a positive int, an unknown activation, activation parameters it
            does not take, lacks or holds out of range (``k`` not a positive int, a NaN threshold, ...;
            :func:`~.activations.check_activation_params`; ``k <= d_sae`` is checked when the module is built),
            a flag of the wrong type; the message names the field.
    """

    d_in: int
    d_sae: int
    activation: str = "relu"
    activation_params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    #: positive-int fields checked by ``__post_init__`` (subclasses extend it).
    _sizes: ClassVar[tuple[str, ...]] = ("d_in", "d_sae")
    #: other typed fields checked by ``__post_init__`` (``bool`` is never an ``int``), per subclass
    _flags: ClassVar[dict[str, type]] = {}

    def __post_init__(self) -> None:
        for name in self._sizes:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise CheckpointError(f"unknown activation {self.activation!r}; known: {list(ACTIVATIONS)}")
        if not isinstance(self.activation_params, dict):
            raise CheckpointError(f"{type(self).__name__}.activation_params must be a mapping, "
                                  f"got {self.activation_params!r}")
        check_activation_params(self.activation, None, self.activation_params)  # k <= d_sae: the module
        if not isinstance(self.extra, dict):
            raise CheckpointError(f"{type(self).__name__}.extra must be a mapping, got {self.extra!r}")
        for name, kind in self._flags.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise CheckpointError(f"{type(self).__name__}.{name} must be {kind.__name__}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        """Inverse of :meth:`to_dict`. Raises :class:`CheckpointError` on unknown or missing keys."""
        check_instance(d, Mapping, f"{cls.__name__}.from_dict", "d", " (to_dict()'s dict)")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise CheckpointError(f"{cls.__name__}: unknown keys {unknown}")
        try:
            return cls(**d)
        except TypeError as e:
            raise CheckpointError(f"{cls.__name__}: {e}") from e


def check_dtype(x: torch.Tensor, weight: torch.Tensor, who: str, what: str) -> None:
    """Raise :class:`ShapeError` unless ``x`` has ``weight``'s dtype (under autocast: any float dtype).

    A shape/dtype check only (no value is read): cheap, and safe inside a trace."""
    if x.dtype == weight.dtype:
        return
    if x.dtype.is_floating_point and torch.is_autocast_enabled(x.device.type):
        return
    raise ShapeError(f"{who} expects {what} in its weights' dtype {weight.dtype}, got dtype {x.dtype} "
                     f"(cast with {what}.to({weight.dtype}) or the module with .to(dtype))")


def check_last_dim(x: torch.Tensor, size: int, who: str, what: str, weight: torch.Tensor | None = None) -> None:
    """Raise :class:`ShapeError` unless ``x`` is a tensor ``(*batch, size)`` with at least one batch dim
    (and, given ``weight``, in its dtype: :func:`check_dtype`)."""
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{who} expects {what} as a tensor (*batch, {size}), got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != size:
        raise ShapeError(f"{who} expects {what} of shape (*batch, {size}), got {tuple(x.shape)}")
    if weight is not None:
        check_dtype(x, weight, who, what)


def affine(x: Float[torch.Tensor, "*batch d"], W: Float[torch.Tensor, "d e"],
           b: Float[torch.Tensor, " e"]) -> Float[torch.Tensor, "*batch e"]:
    """``x W + b`` over the last dim, as one ``addmm``."""
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), W).view(*x.shape[:-1], W.shape[-1])


#: set on a sparse coder, CLT or Lorsa (its ``__dict__``) by :func:`share_encoder_matmul` while a splice runs two
#: passes: ``{"results": [...], "copies": [...]}`` (the computations made, the copies of them handed out)
_MEMO = "_encoder_memo"


def share_encoder_matmul(module: nn.Module) -> bool:
    """From now until :func:`end_encoder_matmul`: ``module``'s computations of its input that no hook point can edit
    are made once per input and shared (a sparse coder's or a CLT's encoder matmul ``x W_enc + b_enc``; a Lorsa's
    queries and keys after QK-norm and RoPE, its values, and its ``z_pre`` from the queries, keys and values after
    ``hook_q``/``hook_k``/``hook_v`` when those hooks handed on the shared ones unedited; any other module, or one
    already sharing: no effect, False).

    A splice with ``error=True`` whose module's internals may be edited runs the module twice at a site, its clean
    pass (stood down) and its live pass, on the same input: the second gets a copy of the first's results instead
    of computing them again. Shared only when it is the same computation (:func:`shared_pre`): the same input tensors
    (the same objects, unmodified since: their version counters), every parameter and buffer of ``module`` the same
    and unmodified, the same grad mode and, for a CLT, the same layer; anything else (an input the trace replaced or
    edited in place, a weight edited, an edit at a hook point in between) computes its own. The copy (``clone``)
    keeps the autograd graph of the one computation and leaves the first pass's tensor untouched by the second's
    edits (of ``hook_sae_acts_pre``, ``hook_q``, ...). Two plain calls, not a context manager: the splice's code
    travels to NDIF by value, whose unpickling refuses ``contextlib``."""
    if not (hasattr(module, "W_enc") or hasattr(module, "W_Q")) or _MEMO in module.__dict__:
        return False
    module.__dict__[_MEMO] = {"results": [], "copies": []}
    return True


def end_encoder_matmul(module: nn.Module) -> None:
    """Ends :func:`share_encoder_matmul` (drops the kept results)."""
    module.__dict__.pop(_MEMO, None)


def _versions(tensors: list[torch.Tensor]) -> list[int] | None:
    """Each tensor's version counter (None: an inference tensor among them, which keeps none)."""
    if any(t.is_inference() for t in tensors):
        return None
    return [t._version for t in tensors]


def _original(t: Any, copies: list) -> Any:
    """``t``, or the result ``t`` is an unmodified copy of (handed out by :func:`shared_pre`)."""
    for copy, version, original in copies:
        if t is copy and t._version == version:
            return original
    return t


def shared_pre(owner: nn.Module, x: Any, tag: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` (``owner``'s computation ``tag`` of ``x``: a CLT's layer for the encoder matmul; a tensor, or a
    tuple of tensors and Nones), or a copy of the same computation's result made earlier since
    :func:`share_encoder_matmul`. ``compute`` returns a tensor or a tuple of tensors; it may read ``owner``'s
    parameters and buffers and nothing else but ``x``. A tensor of ``x`` that is an unmodified copy handed out here
    counts as the result it copies (the live pass's queries passed on unedited by ``hook_q``)."""
    memo = owner.__dict__.get(_MEMO)
    if memo is None:
        return compute()
    inputs = x if isinstance(x, tuple) else (x,)
    if not all(t is None or isinstance(t, torch.Tensor) for t in inputs):
        return compute()  # (compute names what is wrong)
    inputs = tuple(_original(t, memo["copies"]) for t in inputs)
    state = [t for t in inputs if t is not None] + [*owner.parameters(), *owner.buffers()]
    versions = _versions(state)
    if versions is None:
        return compute()
    shape = tuple(t is None for t in inputs)
    grad = torch.is_grad_enabled()
    for m_tag, m_shape, m_grad, m_state, m_versions, result, result_versions in memo["results"]:
        outs = result if isinstance(result, tuple) else (result,)
        if (m_tag == tag and m_shape == shape and m_grad == grad and len(m_state) == len(state)
                and all(a is b for a, b in zip(m_state, state, strict=True)) and m_versions == versions
                and [t._version for t in outs] == result_versions):
            copies = tuple(t.clone() for t in outs)
            memo["copies"].extend((c, c._version, t) for c, t in zip(copies, outs, strict=True))
            return copies if isinstance(result, tuple) else copies[0]
    result = compute()
    outs = result if isinstance(result, tuple) else (result,)
    if not any(t.is_inference() for t in outs):
        memo["results"].append((tag, shape, grad, state, versions, result, [t._version for t in outs]))
    return result


def encode_and_pre_with(x: Float[torch.Tensor, "*batch d"], W_enc: Float[torch.Tensor, "d f"],
                        b_enc: Float[torch.Tensor, " f"], activation: nn.Module, hook_pre: nn.Module,
                        hook_post: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hook_post(σ(hook_pre(x W_enc + b_enc))), x W_enc + b_enc)`` from ONE encoder matmul, the encoder of every
    sparse coder: the features and the pre-activation the matmul gave (before ``hook_pre``; the hook points are
    identities and no activation writes its input)."""
    pre = affine(x, W_enc, b_enc)
    return hook_post(activation(hook_pre(pre))), pre


#: fp32 elements per draw of :func:`init_dictionary_`'s decoder on the CPU (64 MiB): a decoder is drawn in runs of rows
#: this size (a multiple of 16 rows, ≥ 16 elements each: the CPU's ``randn`` fills blocks of 16 from consecutive
#: uniforms, so the runs are the same stream, bit for bit, as one draw:
#: ``tests/modules/test_dictionary_init_placement.py``)
INIT_CHUNK_ELEMENTS = 2**24


def _row_runs(n_rows: int, row_elements: int, device: torch.device) -> list[tuple[int, int]]:
    """``[(r0, r1), …]`` covering ``n_rows`` rows: one run unless drawn on the CPU (another device's generator
    streams differ when a draw is split: it is drawn whole); else runs of ≤ :data:`INIT_CHUNK_ELEMENTS` elements, a
    multiple of 16 rows, the last of ≥ 16 elements (a shorter draw takes another path)."""
    step = max(16, INIT_CHUNK_ELEMENTS // max(row_elements, 1) // 16 * 16)
    if device.type != "cpu" or n_rows <= step:
        return [(0, n_rows)]
    runs = [(r0, min(r0 + step, n_rows)) for r0 in range(0, n_rows, step)]
    if (runs[-1][1] - runs[-1][0]) * row_elements < 16:
        runs[-2:] = [(runs[-2][0], n_rows)]
    return runs


@torch.no_grad()
def init_dictionary_(W_enc: torch.Tensor, W_dec: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Random init: unit-norm decoder rows (as in Bricken et al. 2023, *Towards Monosemanticity*), encoder =
    decoder transposed.

    ``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_out)``; where ``d_in != d_out`` (transcoders)
    the encoder gets its own draw of the same scale (SAELens initialises ``W_enc = W_decᵀ``).

    Drawn in fp32 on ``generator``'s device (the CPU's default generator without one: the same init on every
    device and in every dtype), then cast and copied. Parameters on ``meta`` are left as they are (nothing to
    fill, nothing drawn: a module built on ``meta`` allocates nothing, and ``generator`` does not advance). A
    decoder drawn on the CPU comes in runs of rows (:data:`INIT_CHUNK_ELEMENTS`, the same stream as one draw):
    at most 64 MiB of it on the host at a time, whatever the decoder's size and device (a Llama-3.1-8B CLT's first
    decoder is 4.3 G elements); the encoder's own draw is whole (one layer's ``d_in × d_sae``).
    """
    device = generator.device if generator is not None else torch.device("cpu")
    d_sae, d_out = W_dec.shape
    if not W_dec.is_meta:
        for r0, r1 in _row_runs(d_sae, d_out, device):
            W_dec[r0:r1].copy_(torch.randn(r1 - r0, d_out, generator=generator, dtype=torch.float32, device=device))
        W_dec.div_(W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    if W_enc.is_meta:
        return
    if W_enc.shape == W_dec.T.shape and not W_dec.is_meta:
        W_enc.copy_(W_dec.T)
    else:
        draw = torch.randn(*W_enc.shape, generator=generator, dtype=torch.float32, device=device)
        W_enc.copy_(draw.div_(draw.norm(dim=0, keepdim=True).clamp_min(1e-12)))


class SparseCoder(ReplacementModule):
    """``x (*batch, d_in) -> acts (*batch, d_sae) -> out (*batch, d_out)``; see the module docstring.

    ``d_out`` is ``cfg.d_out`` where the config has one (transcoders), else ``d_in`` (SAEs).
    Subclasses set ``_kind`` (used in messages) and may override :meth:`encoder_input` (SAE
    centering) and :meth:`skip` (skip transcoders).

    Raises:
        ShapeError: an input whose last dim is not ``d_in`` (``d_sae`` for :meth:`decode`).
    """

    _kind: ClassVar[str] = "SparseCoder"

    def __init__(self, cfg: SparseCoderConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super(SparseCoder, self).__init__()
        check_construction(cfg, SparseCoderConfig, device, dtype, type(self).__name__)
        self.cfg = cfg
        self.d_out: int = getattr(cfg, "d_out", None) or cfg.d_in
        self.W_enc = nn.Parameter(torch.empty(cfg.d_in, cfg.d_sae, device=device, dtype=dtype))
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae, device=device, dtype=dtype))
        self.W_dec = nn.Parameter(torch.empty(cfg.d_sae, self.d_out, device=device, dtype=dtype))
        self.b_dec = nn.Parameter(torch.zeros(self.d_out, device=device, dtype=dtype))
        self.reset_parameters()
        self.activation = make_activation(cfg.activation, cfg.d_sae, cfg.activation_params).to(device=device,
                                                                                                 dtype=dtype)
        self.hook_sae_acts_pre = HookPoint()  # x W_enc + b_enc        (*batch, d_sae)
        self.hook_sae_acts_post = HookPoint()  # the features σ(·)      (*batch, d_sae)
        self.hook_sae_recons = HookPoint()  # the output               (*batch, d_out)
        self.hook_error = HookPoint()  # true site output − output when spliced with error=True

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Unit-norm random decoder rows, encoder from the decoder, zero biases (:func:`init_dictionary_`)."""
        init_dictionary_(self.W_enc, self.W_dec, generator)
        self.b_enc.zero_()
        self.b_dec.zero_()

    @property
    def d_in(self) -> int:
        return self.cfg.d_in

    @property
    def d_sae(self) -> int:
        return self.cfg.d_sae

    # --------------------------------------------------------------- forward
    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the encoder multiplies: ``x`` itself ``(*batch, d_in)`` (SAEs may normalise it and subtract
        ``b_dec``).

        Raises:
            ShapeError: ``x`` is not a ``(*batch, d_in)`` tensor in the weights' dtype.
        """
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        return x

    def skip(self, x: torch.Tensor, *, constant_weights: bool = False) -> torch.Tensor | None:
        """A linear path added to the output (None: no skip connection). ``constant_weights``: the weights taken
        detached (the gradient reaches ``x`` only, and autograd keeps no copy of ``x`` for a weight gradient: the
        attribution's frozen pass).

        Raises:
            ShapeError: ``x`` is not a ``(*batch, d_in)`` tensor in the weights' dtype (also without a skip path).
        """
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        return None

    def decoders(self, layer: int) -> dict[int, torch.Tensor]:
        """``{layer: W_dec (d_sae, d_out)}``: the outputs this coder writes when it replaces MLP ``layer``
        (one; a cross-layer transcoder's per-layer view, :class:`~.clt.CLTLayer`, writes several)."""
        return {layer: self.W_dec}

    def encode(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """Feature activations ``σ(x W_enc + b_enc)`` (through ``hook_sae_acts_pre``/``_post``).

        Raises:
            ShapeError: ``x`` is not ``(*batch, d_in)``.
        """
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        pre = shared_pre(self, x, 0, lambda: affine(self.encoder_input(x), self.W_enc, self.b_enc))
        return self.hook_sae_acts_post(self.activation(self.hook_sae_acts_pre(pre)))

    def encode_and_pre(self, x: Float[torch.Tensor, "*batch d_in"]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(encode(x), encoder_input(x) W_enc + b_enc)``: the features and their pre-activations from one encoder
        matmul (the attribution layout of a traced pass needs both; two calls computed the matmul twice).

        Raises:
            ShapeError: ``x`` is not ``(*batch, d_in)``.
        """
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        return encode_and_pre_with(self.encoder_input(x), self.W_enc, self.b_enc, self.activation,
                                   self.hook_sae_acts_pre, self.hook_sae_acts_post)

    def decode(self, acts: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_out"]:
        """``acts W_dec + b_dec`` (no skip path, no hook)."""
        check_last_dim(acts, self.cfg.d_sae, self._kind, "acts", self.W_dec)
        return affine(acts, self.W_dec, self.b_dec)

    def forward(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_out"]:
        """``decode(encode(x)) (+ skip(x))``, through ``hook_sae_recons``."""
        out = self.decode(self.encode(x))
        skip = self.skip(x)
        return self.hook_sae_recons(out if skip is None else out + skip)

    # ------------------------------------------------------ sparse fast path
    @property
    def supports_sparse(self) -> bool:
        """Whether :meth:`encode_sparse` applies: the activation keeps a few entries per row
        (:class:`~.activations.TopK`, :class:`~.activations.BatchTopK`)."""
        return hasattr(self.activation, "select")

    def encode_sparse(
        self, x: Float[torch.Tensor, "*batch d_in"]
    ) -> tuple[Float[torch.Tensor, "n d_sae"], SparseActs]:
        """The training fast path of :meth:`encode` for TopK / BatchTopK coders (:mod:`.sparse_decode`).

        Returns ``(pre, acts)``: the pre-activations ``(n, d_sae)`` of the flattened batch
        (``n = prod(*batch)``), computed without an autograd graph, and the active features as
        :class:`~.sparse_decode.SparseActs`, whose values are differentiable in ``x``, ``W_enc``,
        ``b_enc`` (and ``b_dec`` through an SAE's input centring) with an ``O(nnz · d_in)`` backward.
        ``acts.to_dense()`` equals ``encode(x)`` flattened (same entries kept, same values; a
        BatchTopK in training updates its threshold as :meth:`encode` does). No hook points.

        Raises:
            ShapeError: ``x`` is not ``(*batch, d_in)``.
            CheckpointError: the activation is not TopK / BatchTopK.
        """
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        if not self.supports_sparse:
            raise CheckpointError(f"{self._kind} activation {self.cfg.activation!r} has no sparse fast path")
        x_in = self.encoder_input(x).reshape(-1, self.cfg.d_in)
        with torch.no_grad():
            pre = affine(x_in, self.W_enc, self.b_enc)
        act: Any = self.activation
        rows, cols, offsets = act.select(pre)
        vals = act.activate_selected(gathered_preact(x_in, self.W_enc, self.b_enc, rows, cols, offsets, pre))
        return pre, SparseActs(rows=rows, cols=cols, vals=vals, offsets=offsets, d_sae=self.cfg.d_sae)

    def decode_sparse(self, acts: SparseActs) -> Float[torch.Tensor, "n d_out"]:
        """``acts W_dec + b_dec`` from :class:`~.sparse_decode.SparseActs` (one ``embedding_bag``; no skip path,
        no hook): equals :meth:`decode` of ``acts.to_dense()``.

        Output dtype: the decoder's; under ``torch.autocast`` the dtype autocast gives :meth:`decode` (bf16 / fp16;
        the sum made in the decoder's dtype, then rounded: :func:`~.sparse_decode.sparse_decode`; until 2026-11-28
        the decoder's dtype there too). :meth:`encode_sparse`'s ``pre`` and ``acts.vals`` are, like :meth:`encode`'s
        output, in autocast's dtype there.

        Raises:
            ShapeError: ``acts.vals`` not in the decoder's dtype outside ``torch.autocast`` (under autocast they are
                cast to it for the sum: :func:`~.sparse_decode.sparse_decode`)."""
        check_dtype(acts.vals, self.W_dec, self._kind, "acts.vals")
        return sparse_decode(acts, self.W_dec, self.b_dec)

    # ------------------------------------------------------------- utilities
    @torch.no_grad()
    def fold_decoder_norm_(self) -> None:
        """Rescale so every decoder row has unit norm, moving the norm into the encoder.

        ``W_dec[i] /= n_i``, ``W_enc[:, i] *= n_i``, ``b_enc[i] *= n_i`` (and a JumpReLU threshold
        ``θ_i *= n_i``): exact for ReLU and JumpReLU (``acts_i`` scales by ``n_i``, so each
        feature's contribution is unchanged). For (Batch)TopK the ranking of features may change.
        SAELens ``fold_W_dec_norm``.
        """
        norm = self.W_dec.norm(dim=-1).clamp_min(1e-12)
        self.W_dec.div_(norm[:, None])
        self.W_enc.mul_(norm[None, :])
        self.b_enc.mul_(norm)
        if isinstance(self.activation, JumpReLU):
            self.activation.threshold.mul_(norm)

    def to_jumprelu_(self, bandwidth: float = 1e-3) -> None:
        """Swap a :class:`BatchTopK` activation for its inference :class:`JumpReLU` (in place; cfg too).

        Raises:
            CheckpointError: the activation is not BatchTopK, or ``bandwidth`` not a positive finite number
                (nothing is changed).
        """
        if not isinstance(self.activation, BatchTopK):
            raise CheckpointError(f"{self._kind} activation is {self.cfg.activation!r}, not 'batchtopk'")
        check_activation_params("jumprelu", self.cfg.d_sae, {"bandwidth": bandwidth})  # before anything changes
        self.activation = self.activation.to_jumprelu(bandwidth)
        self.cfg = dataclasses.replace(self.cfg, activation="jumprelu", activation_params={"bandwidth": bandwidth})

    def extra_repr(self) -> str:
        return f"d_in={self.cfg.d_in}, d_sae={self.cfg.d_sae}, d_out={self.d_out}"
