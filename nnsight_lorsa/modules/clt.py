"""Cross-layer transcoder (CLT): features read one layer's MLP input and write to every later MLP output.

Ameisen et al. 2025 (cross-layer transcoders, *Circuit Tracing*; Lindsey et al. 2024, *Sparse
Crosscoders*). For layers ``l = 0 … n_layers−1``, with ``x_l`` the MLP input of layer ``l``::

    acts_l = σ_l(x_l W_enc[l] + b_enc[l])                          (*batch, d_sae)
    ŷ_l'   = Σ_{l ≤ l'} acts_l W_dec_l[:, l' − l] + b_dec[l'] (+ x_l' W_skip[l']ᵀ)   ≈ MLP output l'

Parameters: ``W_enc (n_layers, d_model, d_sae)`` and ``b_enc (n_layers, d_sae)`` (each layer as
an SAE encoder, SAELens orientation; circuit-tracer's per-layer ``W_enc_{l}`` is ``W_enc[l]ᵀ``),
``W_dec_{l} (d_sae, n_layers − l, d_model)`` — circuit-tracer's layout: feature ``i`` of layer
``l`` writes ``W_dec_{l}[i, j]`` to layer ``l + j`` — and ``b_dec (n_layers, d_model)``; with
``skip=True`` also ``W_skip (n_layers, d_model, d_model)`` (each ``(d_out, d_in)`` like
:class:`~.transcoder.SkipTranscoder`; circuit-tracer stores the transpose). One activation per
layer (``activation.{l}``; a JumpReLU's threshold is ``activation.{l}.threshold``).

Hook points, one per layer (``nn.ModuleList`` of :class:`HookPoint`): ``hook_sae_acts_pre[l]``,
``hook_sae_acts_post[l]`` (layer ``l``'s features), ``hook_sae_recons[l]`` (``ŷ_l``) and
``hook_error[l]`` (``MLP_l − ŷ_l`` when spliced with ``error=True``). The encoder and decoder
steps are those of every sparse coder (:func:`~.sparse_coder.encode_and_pre_with`, :func:`~.sparse_coder.affine`).
Needs torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .._placement import fetched_part, offloaded
from .._typing import Float
from ..errors import LayerOutOfRangeError, ShapeError
from .activations import make_activation
from .hook_point import HookPoint
from .replacement_module import ReplacementModule, check_construction
from .sparse_coder import (
    SparseCoderConfig,
    affine,
    check_dtype,
    check_last_dim,
    encode_and_pre_with,
    init_dictionary_,
    shared_pre,
)


@dataclass(kw_only=True, repr=False)
class CLTConfig(SparseCoderConfig):
    """Config of a :class:`CrossLayerTranscoder` (``d_in`` is the model's ``d_model``).

    Attributes:
        n_layers: layers spanned (CLT layer ``l`` is model layer ``l``).
        skip: add a per-layer linear skip path ``x_l W_skip[l]ᵀ``.

    Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
    ``transcoder/cross_layer_transcoder.py``.
    """

    n_layers: int
    skip: bool = False

    _sizes: ClassVar[tuple[str, ...]] = ("d_in", "d_sae", "n_layers")
    _flags: ClassVar[dict[str, type]] = {"skip": bool}

    @property
    def d_model(self) -> int:
        """Width of the residual stream, the MLP input and output (``d_in``).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        return self.d_in


def _hooks(n: int) -> nn.ModuleList:
    return nn.ModuleList(HookPoint() for _ in range(n))


class CrossLayerTranscoder(ReplacementModule):
    """A CLT over ``n_layers`` MLPs; see the module docstring for the equations and layout.

    Per layer (what a replacement spliced into a model runs, one MLP at a time):
    :meth:`encode_layer` ``x_l -> acts_l`` and :meth:`reconstruct_layer` ``(acts_0..acts_l', x_l') -> ŷ_l'``.
    Stacked (all layers at once): :meth:`encode`, :meth:`decode`, :meth:`forward` on
    ``(n_layers, *batch, ·)`` tensors.

    Raises:
        ShapeError: inputs of the wrong width or layer count.
        LayerOutOfRangeError: a layer outside ``[0, n_layers)``.

    Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
    ``transcoder/cross_layer_transcoder.py``.
    """

    _kind: ClassVar[str] = "CrossLayerTranscoder"

    def __init__(self, cfg: CLTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super(CrossLayerTranscoder, self).__init__()
        check_construction(cfg, CLTConfig, device, dtype, "CrossLayerTranscoder")
        n, d, f = cfg.n_layers, cfg.d_in, cfg.d_sae
        self.cfg = cfg
        self.W_enc = nn.Parameter(torch.empty(n, d, f, device=device, dtype=dtype))
        self.b_enc = nn.Parameter(torch.zeros(n, f, device=device, dtype=dtype))
        for layer in range(n):
            W_dec = torch.empty(f, n - layer, d, device=device, dtype=dtype)
            self.register_parameter(f"W_dec_{layer}", nn.Parameter(W_dec))
        self.b_dec = nn.Parameter(torch.zeros(n, d, device=device, dtype=dtype))
        if cfg.skip:
            self.W_skip = nn.Parameter(torch.zeros(n, d, d, device=device, dtype=dtype))
        else:
            self.register_parameter("W_skip", None)
        self.activation = nn.ModuleList(
            make_activation(cfg.activation, f, cfg.activation_params).to(device=device, dtype=dtype) for _ in range(n))
        self.hook_sae_acts_pre = _hooks(n)
        self.hook_sae_acts_post = _hooks(n)
        self.hook_sae_recons = _hooks(n)
        self.hook_error = _hooks(n)  # error terms when spliced with error=True; unused by forward
        self.reset_parameters()

    @property
    def n_layers(self) -> int:
        """Number of MLP layers the CLT reads and writes (``cfg.n_layers``).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        return self.cfg.n_layers

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Per source layer: unit-norm random decoder rows over all its targets, encoder from them;
        zero biases.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        for layer in range(self.cfg.n_layers):
            init_dictionary_(self.W_enc[layer], self.W_dec(layer).view(self.cfg.d_sae, -1), generator)
        for bias in (self.b_enc, self.b_dec):
            bias.zero_()

    def W_dec(self, layer: int) -> Float[torch.Tensor, "d_sae n_out d_model"]:
        """``W_dec_{layer}: (d_sae, n_layers − layer, d_model)``.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        return getattr(self, f"W_dec_{self._check_layer(layer)}")

    def _check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.cfg.n_layers:
            raise LayerOutOfRangeError(f"layer {layer!r} is out of range for a {self.cfg.n_layers}-layer CLT")
        return layer

    # ------------------------------------------------------------- per layer
    def encode_layer(self, x: Float[torch.Tensor, "*batch d_model"], layer: int) -> Float[torch.Tensor, "*batch d_sae"]:
        """Layer ``layer``'s features from its MLP input (through its ``hook_sae_acts_pre``/``_post``).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        self._check_layer(layer)
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        pre = shared_pre(self, x, layer, lambda: affine(x, *self._encoder(layer)))
        return self.hook_sae_acts_post[layer](self.activation[layer](self.hook_sae_acts_pre[layer](pre)))

    def _encoder(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_enc[layer], b_enc[layer])``: inside a ``resident`` block that fetched them alone (``parts``, an
        offloaded CLT's layer in attribution's clean pass) those copies (:func:`~.._placement.fetched_part`)."""
        W, b = fetched_part(self, "W_enc", layer), fetched_part(self, "b_enc", layer)
        return (self.W_enc[layer] if W is None else W), (self.b_enc[layer] if b is None else b)

    def encode_layer_and_pre(self, x: Float[torch.Tensor, "*batch d_model"],
                             layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(encode_layer(x, layer), x W_enc[layer] + b_enc[layer])`` from one encoder matmul.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        self._check_layer(layer)
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        return encode_and_pre_with(x, *self._encoder(layer), self.activation[layer],
                                   self.hook_sae_acts_pre[layer], self.hook_sae_acts_post[layer])

    def decode_layer(self, acts: Sequence[torch.Tensor], layer: int) -> torch.Tensor:
        """``Σ_{l ≤ layer} acts[l] W_dec_l[:, layer − l] + b_dec[layer]``: ``(*batch, d_model)``.

        ``acts``: the features of layers ``0 … layer`` (at least ``layer + 1`` tensors ``(*batch, d_sae)``).

        Raises:
            ShapeError: ``acts`` holds fewer than ``layer + 1`` layers' features.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        self._check_layer(layer)
        if len(acts) <= layer:
            raise ShapeError(f"decoding layer {layer} needs the features of layers 0..{layer}, got {len(acts)}")
        self._check_acts(acts, layer)
        out = affine(acts[layer], self.W_dec(layer)[:, 0], self.b_dec[layer])
        for source in range(layer):
            out = out + acts[source] @ self.W_dec(source)[:, layer - source]
        return out

    def _check_acts(self, acts: Sequence[torch.Tensor], layer: int) -> None:
        """``acts[0..layer]``: tensors ``(*batch, d_sae)`` of one batch shape, in the decoder's dtype
        (shapes and dtypes only: no value is read)."""
        for source in range(layer + 1):  # every width first: a wrong one is named, not the others' batch shape
            a = acts[source]
            if not isinstance(a, torch.Tensor) or a.dim() < 1 or a.shape[-1] != self.cfg.d_sae:
                got = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                raise ShapeError(f"{self._kind} expects acts[{source}] of shape (*batch, d_sae={self.cfg.d_sae}), "
                                 f"got {got}")
        first = acts[layer]
        for source in range(layer + 1):
            a = acts[source]
            if a.shape != first.shape:
                raise ShapeError(f"{self._kind}: acts[{source}] has shape {tuple(a.shape)}, acts[{layer}] "
                                 f"{tuple(first.shape)} (one batch shape for every layer)")
            check_dtype(a, self.b_dec, self._kind, f"acts[{source}]")

    def reconstruct_layer(self, acts: Sequence[torch.Tensor], layer: int,
                          x: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`decode_layer` plus the skip path of ``x`` (layer ``layer``'s MLP input), through
        ``hook_sae_recons[layer]``: the CLT's prediction of MLP output ``layer``, ``(*batch, d_model)``.

        Raises:
            ShapeError: ``acts`` of the wrong width, batch shape or dtype; ``x`` missing (with a skip path)
                or not ``(*batch, d_model)``.
            LayerOutOfRangeError: ``layer`` outside ``[0, n_layers)``.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        out = self.decode_layer(acts, layer)
        if self.W_skip is not None:
            if x is None:
                raise ShapeError("this CLT has a skip connection: reconstruct_layer needs the MLP input x")
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (*out.shape[:-1], self.cfg.d_in):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ShapeError(f"{self._kind} expects x of shape {(*out.shape[:-1], self.cfg.d_in)} (the MLP "
                                 f"input of layer {layer}), got {got}")
            check_dtype(x, self.b_dec, self._kind, "x")
            out = out + x @ self.W_skip[layer].T
        return self.hook_sae_recons[layer](out)

    # --------------------------------------------------------------- stacked
    def _check_stacked(self, t: torch.Tensor, width: int, what: str) -> None:
        if t.dim() < 3 or t.shape[0] != self.cfg.n_layers or t.shape[-1] != width:
            raise ShapeError(f"{self._kind} expects {what} of shape (n_layers={self.cfg.n_layers}, *batch, "
                             f"{width}), got {tuple(t.shape)}")

    def encode(
        self, xs: Float[torch.Tensor, "n_layers *batch d_model"]
    ) -> Float[torch.Tensor, "n_layers *batch d_sae"]:
        """Every layer's features from the stacked MLP inputs ``xs``.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        self._check_stacked(xs, self.cfg.d_in, "xs")
        return torch.stack([self.encode_layer(xs[layer], layer) for layer in range(self.cfg.n_layers)])

    def decode(self, acts: Float[torch.Tensor, "n_layers *batch d_sae"],
               xs: torch.Tensor | None = None) -> Float[torch.Tensor, "n_layers *batch d_model"]:
        """Every layer's reconstruction ``ŷ_l`` (``xs``, the MLP inputs, needed only with a skip path).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        self._check_stacked(acts, self.cfg.d_sae, "acts")
        per_layer = list(acts.unbind(0))
        return torch.stack([self.reconstruct_layer(per_layer, layer, None if xs is None else xs[layer])
                            for layer in range(self.cfg.n_layers)])

    def forward(
        self, xs: Float[torch.Tensor, "n_layers *batch d_model"]
    ) -> Float[torch.Tensor, "n_layers *batch d_model"]:
        """``decode(encode(xs), xs)``: the predicted MLP outputs of every layer.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); *From Tokenization to Attribution
        Graphs* §7.1.
        """
        return self.decode(self.encode(xs), xs)

    def extra_repr(self) -> str:
        """``n_layers``, ``d_model``, ``d_sae`` and ``skip`` for ``repr``.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        c = self.cfg
        return f"n_layers={c.n_layers}, d_model={c.d_in}, d_sae={c.d_sae}, skip={c.skip}"

    def by_layer(self) -> dict[int, CLTLayer]:
        """``{layer: CLTLayer}``: each layer seen as a transcoder (the attribution graph's per-layer view).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); circuit-tracer
        ``transcoder/cross_layer_transcoder.py``.
        """
        return {layer: CLTLayer(self, layer) for layer in range(self.cfg.n_layers)}


class CLTLayer(ReplacementModule):
    """Layer ``layer`` of a :class:`CrossLayerTranscoder` seen as a transcoder: encoder at ``layer``,
    ``b_dec`` / skip of MLP ``layer``, decoders into every MLP ``l' ≥ layer`` (:meth:`decoders`). A view:
    its only submodule is the CLT (``.to`` / ``copy.deepcopy`` with a shared memo move or copy that one
    CLT; its tensors are read from it on every access).
    """

    def __init__(self, clt: CrossLayerTranscoder, layer: int) -> None:
        super(CLTLayer, self).__init__()
        self.clt, self.layer = clt, clt._check_layer(layer)

    @property
    def weights_owner(self) -> CrossLayerTranscoder:
        """The CLT: this view computes with its weights (placement and offload act on it)."""
        return self.clt

    @property
    def W_enc(self) -> Float[torch.Tensor, "d_model d_sae"]:
        return self.clt.W_enc[self.layer]

    @property
    def b_enc(self) -> Float[torch.Tensor, " d_sae"]:
        return self.clt.b_enc[self.layer]

    @property
    def b_dec(self) -> Float[torch.Tensor, " d_model"]:
        return self.clt.b_dec[self.layer]

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """What layer ``layer``'s encoder multiplies: ``x`` itself ``(*batch, d_model)``.

        Raises:
            ShapeError: ``x`` is not a ``(*batch, d_model)`` tensor in the CLT's dtype.
        """
        check_last_dim(x, self.clt.cfg.d_in, f"{self.clt._kind} layer {self.layer}", "x", self.clt.b_dec)
        return x

    def encode(self, x: Float[torch.Tensor, "*batch d_model"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """``(*batch, d_sae)`` layer ``layer``'s features (the CLT's own encoder, activation included)."""
        return self.clt.encode_layer(x, self.layer)

    def encode_and_pre(self, x: Float[torch.Tensor, "*batch d_model"]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(encode(x), x W_enc + b_enc)`` from one encoder matmul (``CrossLayerTranscoder.encode_layer_and_pre``)."""
        return self.clt.encode_layer_and_pre(x, self.layer)

    def skip(self, x: torch.Tensor, *, constant_weights: bool = False) -> torch.Tensor | None:
        """The skip path of MLP ``layer`` (None without one; ``constant_weights``: ``W_skip`` detached, the gradient
        reaching ``x`` only — :meth:`~.sparse_coder.SparseCoder.skip`).

        Raises:
            ShapeError: ``x`` is not a ``(*batch, d_model)`` tensor in the CLT's dtype (also without a skip path).
        """
        check_last_dim(x, self.clt.cfg.d_in, f"{self.clt._kind} layer {self.layer}", "x", self.clt.b_dec)
        if self.clt.W_skip is None:
            return None
        # offloaded, in a resident block that fetched this layer's matrix alone (the attribution's MLP site): that copy
        fetched = fetched_part(self.clt, "W_skip", self.layer)
        W: torch.Tensor = self.clt.W_skip[self.layer] if fetched is None else fetched
        W = W.detach() if constant_weights else W
        # offloaded, read from every layer's: this layer's matrix copied out, so that the backward keeps it alone
        return x @ W.T.to(x.dtype, copy=fetched is None and offloaded(self.clt))

    def decoders(self, layer: int | None = None) -> dict[int, torch.Tensor]:
        """``{target layer l' ≥ layer: W_dec (d_sae, d_model)}`` (``layer``: the view's own, as the
        per-layer coders' :meth:`~.sparse_coder.SparseCoder.decoders` take it)."""
        W = self.clt.W_dec(self.layer)
        return {self.layer + j: W[:, j] for j in range(W.shape[1])}
