"""Training data: token windows, and one activation source for every trained module.

:class:`TokenDataset` cuts a corpus into fixed-length windows that start with BOS.
:class:`ActivationSource` maps a batch index to a :class:`Batch` of the activations of named
:class:`~..envoy.read.Site` s on that batch's windows — live, running the model under one
``model.trace`` that stops after the last site (:func:`~..envoy.read.read_sites`), or from an
on-disk :class:`~.activation_cache.ActivationCache` (the same windows and values). Batch ``i``
depends only on ``i`` (a seeded permutation of the windows per epoch), so a run resumes at any
batch without replaying earlier ones. What a module reads and writes (Lorsa paper §3.2; Ameisen et al. 2025,
*Circuit Tracing*, cross-layer transcoders):

* Lorsa of layer ``L`` — attention input -> attention output, with positions
  (:meth:`ActivationSource.attention`);
* SAE — one site -> itself (:meth:`ActivationSource.sae`);
* transcoder of layer ``L`` — MLP input -> MLP output (:meth:`ActivationSource.transcoder`);
* CLT — every layer's MLP input -> every MLP output, stacked ``(n_layers, batch, pos, d_model)``
  (:meth:`ActivationSource.clt`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import is_int
from .._placement import model_device
from .._typing import Bool, Float, Int
from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import adapter_for, get_adapter
from ..envoy.read import Site, read_sites
from ..errors import ActivationCacheError, ArgumentError, LayerOutOfRangeError, ShapeError
from .activation_cache import ActivationCache
from .dataset import TokenDataset, _loss_mask, _refuse_left_padding, _window_ids, check_dataset_ids


@dataclass
class Batch:
    """One batch of activations (what :class:`ActivationSource` returns and the trainer consumes).

    Attributes:
        x: what the module reads, ``(batch, pos, d_in)`` — or ``(n_sites, batch, pos, d_in)`` for a
            stacked source (a CLT: every layer's MLP input).
        y: what it reconstructs, shaped like ``x`` (``d_out`` last); the same tensor as ``x`` for an SAE.
        loss_mask: ``(batch, pos)`` bool, False at BOS (column 0) and wherever the dataset's
            ``target_mask`` is False (padding): excluded from the loss, scale factors and dead counters.
        positions: ``(batch, pos)`` or ``(pos,)`` token positions (RoPE; a Lorsa's source), else None.
        attn_mask: ``(batch, pos)`` 1 = real token (key padding), or None when unpadded.
    """

    x: Float[torch.Tensor, "... batch pos d_in"]
    y: Float[torch.Tensor, "... batch pos d_out"]
    loss_mask: Bool[torch.Tensor, "batch pos"]
    positions: Int[torch.Tensor, "..."] | None = None
    attn_mask: torch.Tensor | None = None

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        """This batch on ``device`` with ``x`` / ``y`` in ``dtype`` (a module's boundary; an SAE batch's
        shared ``y is x`` stays shared), masks and positions moved only; ``self`` when nothing changes."""
        x = self.x.to(device=device, dtype=dtype)
        y = x if self.y is self.x else self.y.to(device=device, dtype=dtype)
        fields: dict[str, Any] = {"x": x, "y": y}
        for name in ("loss_mask", "positions", "attn_mask"):
            value = getattr(self, name)
            fields[name] = value.to(device) if isinstance(value, torch.Tensor) else value
        if all(fields[k] is getattr(self, k) for k in fields):
            return self
        return dataclasses.replace(self, **fields)


def checked_batch(batch: Any, index: int) -> Batch:
    """``batch`` — what a trainer's source returned for batch ``index`` — when it is a :class:`Batch`.

    Raises:
        ArgumentError: it is not (e.g. ``None`` or a bare tensor from a source written by hand); the message names
            the index and what a source must return.

    Source: ours (the trainer's source contract).
    """
    if not isinstance(batch, Batch):
        raise ArgumentError(
            f"the training source returned a {type(batch).__name__} for batch {index}, not a Batch: a source is a "
            "callable index -> nnsight_lorsa.training.activations.Batch(x=..., y=..., loss_mask=...) "
            "(e.g. an ActivationSource)")
    return batch


_SiteSpec = Site | Sequence[Site]


def _sites(spec: Any, name: str) -> tuple[Site, ...]:
    """``spec`` (a :class:`Site`, or a non-empty list / tuple of them) as a tuple of sites.

    Raises:
        ArgumentError: anything else — a module path string (a sequence of characters, not of sites), an empty
            list, an element that is not a Site — naming the argument.
    """
    if isinstance(spec, Site):
        return (spec,)
    if isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)) and spec \
            and all(isinstance(s, Site) for s in spec):
        return tuple(spec)
    raise ArgumentError(f"ActivationSource({name}=...) must be a Site or a non-empty list of Sites (Site.mlp_input("
                        f"adapter, layer), Site.resid_post(adapter, layer), ...), got {spec!r}")


class ActivationSource:
    """Batch ``i`` = the values of sites ``x`` (read) and ``y`` (target) on batch ``i`` of the windows.

    Args:
        data: an nnsight-wrapped model (live: one ``model.trace`` per batch, stopped after the last
            site) or an :class:`~.activation_cache.ActivationCache` holding the sites (the same batches).
        x: the site the module reads, or a sequence of sites (stacked into ``(n_sites, batch, pos, d)``).
        y: the target site(s); default ``x`` (an SAE: ``batch.y is batch.x``).
        dataset: the :class:`TokenDataset` (live); ignored for a cache, which holds its own windows.
        batch_size: windows per batch. seed: shuffling seed.
        positions: a ``"positions"`` site to read into :attr:`Batch.positions` (live only).

    Devices and dtypes: a live source runs the model where it is (the windows are moved to the
    model's device) and returns ``x`` / ``y`` / ``positions`` on the model's device in its dtype, the
    ``loss_mask`` on the CPU; a cached source returns CPU tensors in the cache's storage dtype. The
    :class:`~.trainer.Trainer` moves every batch to the trained module's device and dtype.

    The constructors :meth:`attention`, :meth:`transcoder`, :meth:`sae` and :meth:`clt` name the
    sites of each module kind; on a cache they need ``adapter=`` (the model's
    :class:`~..adapters.base.ArchitectureAdapter`) to name them.

    Attributes:
        n_layers, d_model: for a stacked source, the number of stacked sites and the width of the
            first (checked by the CLT objective); None otherwise.

    Raises:
        ActivationCacheError: a site is not in the cache, or positions are asked of a cache.
        ArgumentError: (a ``ValueError``) a live source without a :class:`TokenDataset` (None, or a tensor of
            windows); ``batch_size`` not an int ≥ 1, ``seed`` not an int; a constructor on a cache without
            ``adapter=``; :meth:`shard`'s ``rank`` outside ``[0, world)``; a live source's dataset holding an id
            outside the model's vocabulary or windows longer than its learned positions
            (:func:`~.dataset.check_dataset_ids`: at construction, not when the trainer reaches the window).

    Source: ours (the batch source of this package's trainer).
    """

    def __init__(self, data: Any, x: Any, y: Any = None, dataset: TokenDataset | None = None,
                 batch_size: int = 16, seed: int = 0, *, positions: Site | None = None) -> None:
        # x, y: a Site or a sequence of Sites (_SiteSpec), checked here: a named error, not a type-checker one
        if not is_int(batch_size) or batch_size < 1:
            raise ArgumentError(f"ActivationSource(batch_size=...) must be an int >= 1, got {batch_size!r}")
        if not is_int(seed):
            raise ArgumentError(f"ActivationSource(seed=...) must be an int, got {seed!r}")
        self.data = data
        self.stacked = not isinstance(x, Site)
        self.x_sites: tuple[Site, ...] = _sites(x, "x")
        y = x if y is None else y
        self.y_sites: tuple[Site, ...] = _sites(y, "y")
        self.positions_site = positions
        self.batch_size, self.seed = batch_size, seed
        self._shard = (0, 1)
        self.cache: ActivationCache | None = data if isinstance(data, ActivationCache) else None
        self.n_layers: int | None = len(self.x_sites) if self.stacked else None
        self.d_model: int | None = None
        if self.cache is not None:
            if positions is not None:
                raise ActivationCacheError("positions are not cached: read a Lorsa's activations live")
            self._names = {s: self.cache.site(s) for s in (*self.x_sites, *self.y_sites)}
            self.n_windows = self.cache.n_windows
            if self.stacked:
                self.d_model = self.cache.width(self.x_sites[0])
        else:
            if not isinstance(dataset, TokenDataset):
                raise ArgumentError(f"ActivationSource(dataset={type(dataset).__name__}) on a {type(data).__name__}: "
                                    "a live source (activations computed from a model) needs dataset=TokenDataset(...)"
                                    " (TokenDataset(tokens) for a tensor of windows)")
            self.adapter = get_adapter(data)
            check_dataset_ids(dataset, data, "ActivationSource")
            self.n_windows = len(dataset)
            if self.stacked:
                self.d_model = int(self.adapter.d_model)
        self.dataset = dataset

    # ------------------------------------------------------------ constructors
    @staticmethod
    def _adapter(data: Any, adapter: ArchitectureAdapter | None) -> ArchitectureAdapter:
        if adapter is None and isinstance(data, ActivationCache):
            raise ArgumentError("ActivationSource on an ActivationCache: pass adapter= (the model's adapter names "
                                "the sites the cache holds)")
        return adapter_for(data, adapter, "ActivationSource")

    @classmethod
    def attention(cls, model: Any, layer: int, dataset: TokenDataset, batch_size: int,
                  seed: int = 0) -> ActivationSource:
        """A Lorsa's stream: layer ``layer``'s attention input -> attention output, with positions.

        Raises:
            LayerOutOfRangeError: ``layer`` outside the model.

        Source: Lorsa paper (He et al. 2025) §3.2 (attention input -> attention output).
        """
        a = get_adapter(model)
        return cls(model, Site.attn_input(a, layer), Site.attn_output(a, layer), dataset, batch_size, seed,
                   positions=Site.attn_positions(a, layer))

    @classmethod
    def transcoder(cls, data: Any, layer: int, dataset: TokenDataset | None = None, batch_size: int = 16,
                   seed: int = 0, *, adapter: ArchitectureAdapter | None = None) -> ActivationSource:
        """A transcoder's stream: layer ``layer``'s MLP input -> its output (live or cached).

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits* (MLP input -> MLP output).
        """
        a = cls._adapter(data, adapter)
        return cls(data, Site.mlp_input(a, layer), Site.mlp_output(a, layer), dataset, batch_size, seed)

    @classmethod
    def sae(cls, data: Any, site: Any, dataset: TokenDataset | None = None, batch_size: int = 16,
            seed: int = 0) -> ActivationSource:
        """An SAE's stream: input = target = ``site`` (a :class:`Site`; live or cached).

        Raises:
            ArgumentError: ``site`` is not a Site (e.g. a module path string).

        Source: Bricken et al. 2023, *Towards Monosemanticity* (input = target).
        """
        return cls(data, site, None, dataset, batch_size, seed)

    @classmethod
    def clt(cls, data: Any, dataset: TokenDataset | None = None, batch_size: int = 16, seed: int = 0,
            n_layers: int | None = None, *, adapter: ArchitectureAdapter | None = None) -> ActivationSource:
        """A CLT's stream: the MLP inputs -> MLP outputs of layers ``0 … n_layers−1`` (default all),
        stacked ``(n_layers, batch, pos, d_model)``; layer ``l`` equals :meth:`transcoder` of ``l``.

        Raises:
            LayerOutOfRangeError: ``n_layers`` exceeds the model's layer count (or is < 1).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders).
        """
        a = cls._adapter(data, adapter)
        if n_layers is not None and (not is_int(n_layers) or n_layers < 1):
            raise LayerOutOfRangeError(f"ActivationSource.clt(n_layers=...) must be None or an int in [1, "
                                       f"{a.n_layers}] (the layers 0 … n_layers−1), got {n_layers!r}")
        n = a.n_layers if n_layers is None else a.check_layer(n_layers - 1) + 1
        return cls(data, [Site.mlp_input(a, layer) for layer in range(n)],
                   [Site.mlp_output(a, layer) for layer in range(n)], dataset, batch_size, seed)

    def shard(self, rank: int, world: int) -> ActivationSource:
        """The same stream restricted to rank ``rank``'s contiguous part of each batch's windows (of
        ``world`` parts, ``torch.tensor_split``): only those windows are computed or read.

        Raises:
            ArgumentError: ``rank`` not in ``[0, world)``.

        Source: ours (the batch source of this package's trainer).
        """
        if not 0 <= rank < world:
            raise ArgumentError(f"ActivationSource.shard: rank={rank!r} is not in [0, world={world!r})")
        out = copy.copy(self)
        out._shard = (rank, world)
        return out

    # ------------------------------------------------------------ reading
    def window_ids(self, index: int) -> Int[torch.Tensor, " n"]:
        """The windows of batch ``index`` (this rank's part of it under :meth:`shard`).

        Source: ours (the batch source of this package's trainer).
        """
        ids = _window_ids(self.n_windows, index, self.batch_size, self.seed)
        rank, world = self._shard
        return ids.tensor_split(world)[rank] if world > 1 else ids

    def _assemble(self, values: dict[Site, torch.Tensor], loss_mask: torch.Tensor,
                  positions: torch.Tensor | None) -> Batch:
        def pick(sites: tuple[Site, ...]) -> torch.Tensor:
            return torch.stack([values[s] for s in sites]) if self.stacked else values[sites[0]]

        x = pick(self.x_sites)
        y = x if self.y_sites == self.x_sites else pick(self.y_sites)
        return Batch(x=x, y=y, loss_mask=loss_mask, positions=positions)

    def read(self, input_ids: Int[torch.Tensor, "batch pos"], target_mask: torch.Tensor | None = None) -> Batch:
        """The batch of these sites on the token windows ``input_ids`` (live sources only);
        ``target_mask`` ``(batch, pos)`` bool: the positions that count (default all but BOS), as
        :attr:`~.dataset.TokenDataset.target_mask`. ``input_ids`` may be on any device (moved to the
        model's); the batch's activations are on the model's device, its ``loss_mask`` on ``input_ids``'.

        Raises:
            ActivationCacheError: a cached source.
            ArgumentError: a ``target_mask`` of left padding (as :class:`~.dataset.TokenDataset` refuses).
            ShapeError: a ``target_mask`` of another shape than ``input_ids``.
            PlacementError: the model is on the meta device (not dispatched).

        Source: ours (the batch source of this package's trainer).
        """
        if self.cache is not None:
            raise ActivationCacheError("a cached source reads its own windows: call source(index)")
        if target_mask is not None:
            if tuple(target_mask.shape) != tuple(input_ids.shape):
                raise ShapeError(f"ActivationSource.read: target_mask must be {tuple(input_ids.shape)} like "
                                 f"input_ids, got {tuple(target_mask.shape)}")
            _refuse_left_padding(input_ids, target_mask, "ActivationSource.read")
        return self._read(input_ids, target_mask)

    def _read(self, input_ids: torch.Tensor, target_mask: torch.Tensor | None) -> Batch:
        """:meth:`read` of a dataset's windows (its mask checked once, at the whole dataset)."""
        sites = {f"s{i}": s for i, s in enumerate(dict.fromkeys((*self.x_sites, *self.y_sites)))}
        if self.positions_site is not None:
            sites["positions"] = self.positions_site
        got = read_sites(self.data, sites, input_ids.to(model_device(self.data)), adapter=self.adapter)
        values = {s: got[name] for name, s in sites.items()}
        positions = got["positions"] if self.positions_site is not None else None
        return self._assemble(values, _loss_mask(input_ids, target_mask), positions)

    def __call__(self, index: int) -> Batch:
        ids = self.window_ids(index)
        if self.cache is None:
            assert self.dataset is not None
            mask = self.dataset.target_mask
            return self._read(self.dataset.tokens[ids], None if mask is None else mask[ids])
        values = {s: self.cache.windows(name, ids) for s, name in self._names.items()}
        return self._assemble(values, self.cache.windows("loss_mask", ids), None)
