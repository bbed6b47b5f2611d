"""Attention activations collected through nnsight, batch by batch (never the whole set in memory).

A Lorsa for layer ``L`` is trained on pairs (Lorsa paper §3.2): input = the hidden states the
attention reads (after the pre-attention norm), target = the attention output (after the
output projection). :class:`TokenDataset` cuts a corpus into fixed-length windows that start
with BOS; :class:`AttentionActivationSource` maps a batch index to that batch's activations by
running the model under ``model.trace`` up to layer ``L`` (``tracer.stop()`` skips the rest), so
a training run can resume at any batch without replaying earlier ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import nnsight
import torch

from .._typing import Bool, Float, Int
from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter


@dataclass
class AttentionBatch:
    """One batch of attention activations.

    Attributes:
        x: ``(batch, pos, d_model)`` attention input hidden states (after the pre-attention norm).
        y: ``(batch, pos, d_model)`` attention output (after the output projection).
        positions: ``(batch, pos)`` or ``(pos,)`` token positions (for RoPE).
        loss_mask: ``(batch, pos)`` bool, False at BOS and padding (excluded from the loss).
        attn_mask: ``(batch, pos)`` 1 = real token (key padding), or None when unpadded.
    """

    x: Float[torch.Tensor, "batch pos d_model"]
    y: Float[torch.Tensor, "batch pos d_model"]
    positions: Int[torch.Tensor, "..."]
    loss_mask: Bool[torch.Tensor, "batch pos"]
    attn_mask: torch.Tensor | None = None


@runtime_checkable
class ActivationSource(Protocol):
    """Deterministic map from a batch index to an :class:`AttentionBatch` (resumable streams)."""

    def __call__(self, index: int) -> AttentionBatch: ...


class TokenDataset:
    """A corpus cut into ``(n_windows, seq_len)`` token windows, each starting with BOS.

    Args:
        tokens: ``(n_windows, seq_len)`` int64 token ids.
        target_mask: optional ``(n_windows, seq_len)`` bool — the tokens whose prediction counts in
            the evaluations' CE and KL (e.g. only the answers of a task dataset; column 0 is never
            predicted); default all.

    Raises:
        ValueError: ``tokens`` empty or not 2-D, or ``target_mask`` of another shape.
    """

    def __init__(self, tokens: Int[torch.Tensor, "n seq"], target_mask: torch.Tensor | None = None) -> None:
        if tokens.dim() != 2 or tokens.shape[0] == 0:
            raise ValueError(f"tokens must be a non-empty (n_windows, seq_len) tensor, got {tuple(tokens.shape)}")
        if target_mask is not None and tuple(target_mask.shape) != tuple(tokens.shape):
            raise ValueError(f"target_mask must be {tuple(tokens.shape)} like tokens, got {tuple(target_mask.shape)}")
        self.tokens = tokens
        self.target_mask = None if target_mask is None else target_mask.bool()

    @classmethod
    def from_text(cls, tokenizer: Any, text: str, seq_len: int, bos_token_id: int | None = None) -> TokenDataset:
        """Tokenize ``text`` once (no special tokens) and cut it into windows of ``seq_len``.

        Each window is ``[BOS] + seq_len-1`` corpus tokens (BOS from the tokenizer unless given).
        """
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id if bos_token_id is None else bos_token_id
        body = seq_len - 1 if bos is not None else seq_len
        n = len(ids) // body
        if n == 0:
            raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {seq_len}")
        t = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
        if bos is not None:
            t = torch.cat([torch.full((n, 1), bos, dtype=torch.long), t], dim=1)
        return cls(t)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def split(self, holdout_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """(train, held-out): the last ``holdout_fraction`` of windows are held out."""
        n_hold = max(1, int(len(self) * holdout_fraction))
        m = self.target_mask
        return (TokenDataset(self.tokens[:-n_hold], None if m is None else m[:-n_hold]),
                TokenDataset(self.tokens[-n_hold:], None if m is None else m[-n_hold:]))

    def targets(self, start: int, stop: int) -> torch.Tensor | None:
        """``target_mask`` of windows ``start:stop`` (None: every token counts)."""
        return None if self.target_mask is None else self.target_mask[start:stop]

    def batch(self, index: int, batch_size: int, seed: int = 0) -> Int[torch.Tensor, "batch seq"]:
        """Batch ``index`` of an endless shuffled stream (a new permutation each epoch, from ``seed``)."""
        per_epoch = max(1, len(self) // batch_size)
        epoch, k = divmod(index, per_epoch)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self), generator=g)
        return self.tokens[perm[k * batch_size:(k + 1) * batch_size]]


@torch.no_grad()
def attention_activations(
    model: Any,
    layer: int,
    input_ids: Int[torch.Tensor, "batch pos"],
    attention_mask: torch.Tensor | None = None,
    adapter: ArchitectureAdapter | None = None,
) -> AttentionBatch:
    """Run ``model`` under ``model.trace`` and return layer ``layer``'s attention input and output.

    The trace stops right after the attention, so later layers are not computed.

    Raises:
        LayerOutOfRangeError: ``layer`` outside the model.
    """
    adapter = get_adapter(model) if adapter is None else adapter
    attn = model.get(adapter.attention_path(layer))
    inputs: dict[str, Any] = {"input_ids": input_ids}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    with model.trace(inputs, use_cache=False) as tracer:
        args, kwargs = attn.inputs
        x = adapter.attention_input(args, kwargs)
        saved_x = nnsight.save(x)
        saved_pos = nnsight.save(adapter.attention_positions(args, kwargs, x))
        saved_y = nnsight.save(adapter.attention_output(attn.output))
        tracer.stop()
    return AttentionBatch(x=saved_x, y=saved_y, positions=saved_pos, loss_mask=loss_mask_for(input_ids, attention_mask),
                          attn_mask=attention_mask)


class AttentionActivationSource:
    """Batch ``i`` = layer ``layer``'s attention activations on token batch ``i`` of ``dataset``.

    Args:
        model: nnsight-wrapped model. layer: target layer. dataset: :class:`TokenDataset`.
        batch_size: windows per batch. seed: shuffling seed.
    """

    def __init__(self, model: Any, layer: int, dataset: TokenDataset, batch_size: int, seed: int = 0) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.layer = self.adapter.check_layer(layer)
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed

    def __call__(self, index: int) -> AttentionBatch:
        ids = self.dataset.batch(index, self.batch_size, self.seed)
        return attention_activations(self.model, self.layer, ids, adapter=self.adapter)


# --------------------------------------------------------------------------- any site
@dataclass
class SiteBatch:
    """One batch of (input, target) activations for a sparse coder (SAE: input = target).

    Attributes:
        x: ``(batch, pos, d_in)`` what the dictionary reads.
        y: ``(batch, pos, d_out)`` what it reconstructs.
        loss_mask: ``(batch, pos)`` bool, False at BOS and padding.
    """

    x: Float[torch.Tensor, "batch pos d_in"]
    y: Float[torch.Tensor, "batch pos d_out"]
    loss_mask: Bool[torch.Tensor, "batch pos"]


@dataclass(frozen=True)
class Site:
    """A value in the forward pass: the ``"input"`` (first argument) or ``"output"`` (first element
    if a tuple) of the module at ``path`` (envoy path below the nnsight root, e.g. ``"model.layers.2"``)."""

    path: str
    kind: str = "output"

    def __post_init__(self) -> None:
        if self.kind not in ("input", "output"):
            raise ValueError(f"Site.kind must be 'input' or 'output', got {self.kind!r}")

    @classmethod
    def mlp_input(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """What layer ``layer``'s MLP reads (after the pre-MLP norm): a transcoder's input."""
        return cls(adapter.mlp_path(adapter.check_layer(layer)), "input")

    @classmethod
    def mlp_output(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """What layer ``layer``'s MLP returns: a transcoder's target."""
        return cls(adapter.mlp_path(adapter.check_layer(layer)), "output")

    @classmethod
    def resid_post(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """The residual stream after decoder layer ``layer`` (its output)."""
        return cls(adapter.layer_path(adapter.check_layer(layer)), "output")


def _read_site(envoy: Any, site: Site, adapter: ArchitectureAdapter) -> Any:
    if site.kind == "input":
        args, kwargs = envoy.inputs
        return adapter.mlp_input(args, kwargs)  # first positional argument / hidden_states
    out = envoy.output
    return out[0] if isinstance(out, (tuple, list)) else out


def loss_mask_for(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(batch, pos)`` bool: real tokens except BOS (column 0)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    loss_mask = real.clone()
    loss_mask[:, 0] = False
    return loss_mask


@torch.no_grad()
def site_activations(model: Any, input_site: Site, target_site: Site, input_ids: Int[torch.Tensor, "batch pos"],
                     attention_mask: torch.Tensor | None = None,
                     adapter: ArchitectureAdapter | None = None) -> SiteBatch:
    """Run ``model`` under one ``model.trace`` and return ``(input_site, target_site)`` values.

    The sites are read in execution order (input first) and the trace stops after the target.
    """
    adapter = get_adapter(model) if adapter is None else adapter
    inputs: dict[str, Any] = {"input_ids": input_ids}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    with model.trace(inputs, use_cache=False) as tracer:
        saved_x = nnsight.save(_read_site(model.get(input_site.path), input_site, adapter))
        if target_site == input_site:
            saved_y = saved_x
        else:
            saved_y = nnsight.save(_read_site(model.get(target_site.path), target_site, adapter))
        tracer.stop()
    return SiteBatch(x=saved_x, y=saved_y, loss_mask=loss_mask_for(input_ids, attention_mask))


class SiteActivationSource:
    """Batch ``i`` = (``input_site``, ``target_site``) activations on token batch ``i`` of ``dataset``.

    SAE on the residual after layer 2: ``SiteActivationSource(model, Site("model.layers.2"),
    Site("model.layers.2"), data, 16)``; transcoder of layer 1: :meth:`transcoder`.
    """

    def __init__(self, model: Any, input_site: Site, target_site: Site, dataset: TokenDataset, batch_size: int,
                 seed: int = 0) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.input_site, self.target_site = input_site, target_site
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self._shard = (0, 1)

    def shard(self, rank: int, world: int) -> SiteActivationSource:
        """The same stream restricted to rank ``rank``'s contiguous part of each batch's windows (of
        ``world`` parts, ``torch.tensor_split``): the model runs on those windows only."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        out = SiteActivationSource(self.model, self.input_site, self.target_site, self.dataset, self.batch_size,
                                   self.seed)
        out._shard = (rank, world)
        return out

    @classmethod
    def transcoder(cls, model: Any, layer: int, dataset: TokenDataset, batch_size: int,
                   seed: int = 0) -> SiteActivationSource:
        """Input = layer ``layer``'s MLP input, target = its output."""
        a = get_adapter(model)
        return cls(model, Site.mlp_input(a, layer), Site.mlp_output(a, layer), dataset, batch_size, seed)

    @classmethod
    def sae(cls, model: Any, site: Site, dataset: TokenDataset, batch_size: int, seed: int = 0) -> SiteActivationSource:
        """Input = target = ``site``."""
        return cls(model, site, site, dataset, batch_size, seed)

    def __call__(self, index: int) -> SiteBatch:
        ids = self.dataset.batch(index, self.batch_size, self.seed)
        rank, world = self._shard
        if world > 1:
            ids = ids.tensor_split(world)[rank]
        return site_activations(self.model, self.input_site, self.target_site, ids, adapter=self.adapter)
