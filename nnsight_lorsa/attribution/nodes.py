"""The nodes of an attribution graph: the node kinds, where graphs live (:data:`HOST`), and
:class:`NodeTable` — one entry per node (kind, layer, position, index, activation, intervened mark) with
its residual-stream site order. What the rows and columns of :class:`.graph.Graph`'s adjacency are;
:mod:`.graph` re-exports every name. torch only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .._repr import FieldsRepr

#: node kinds (``NodeTable.kind``), with their Neuronpedia ``feature_type`` names
TRANSCODER, LORSA, MLP_ERROR, ATTN_ERROR, EMBEDDING, BIAS, LOGIT = range(7)
KIND_NAMES = ("cross layer transcoder", "lorsa", "mlp reconstruction error", "lorsa error",
              "embedding", "bias", "logit")
SHORT_NAMES = ("tc", "lorsa", "mlp_err", "attn_err", "emb", "bias", "logit")
#: where a graph, its node tables and its stored rows live, whatever the model's device: the host
#: (the frozen pass runs on the model's device; its rows are copied here as each batch is computed)
HOST = torch.device("cpu")
#: :meth:`NodeTable.sites` per kind: ``mult · layer + offset`` (MLP nodes ``2l + 2``, attention nodes ``2l + 1``,
#: embeddings 0, biases -1, logits ``2l + 3``)
_SITE_MULT = (2, 2, 2, 2, 0, 0, 2)
_SITE_OFFSET = (2, 1, 2, 1, 0, -1, 3)
#: the bias names (:mod:`.layout`) a layer's attention side adds: its pre-attention norm's, the Lorsa's ``b_V`` /
#: ``b_D``, the (frozen, possibly sparse) MHSA's ``b_V`` / ``b_O``; the MLP side's are ``L<l>.mlp_norm.bias`` and
#: ``L<l>.transcoder.*``, the top's ``final_norm.bias`` / ``lm_head.bias``
ATTENTION_BIAS = re.compile(r"L[0-9]+\.(attn_norm|lorsa|attn)\.")


def count_distinct(idx: torch.Tensor) -> int:
    """The number of distinct values of the 1-D int tensor ``idx`` (a layout's OV heads or features): one
    ``bincount`` where they are non-negative (a node id's range: ~30× faster than ``unique``'s sort on the 8B shape's
    131 k nodes a layer, which the memory plan counted ~130 times a call), else ``unique``. Reads ``idx`` (a host
    read off the CPU)."""
    if not idx.numel():
        return 0
    if int(idx.min()) >= 0:
        return int(torch.count_nonzero(torch.bincount(idx.reshape(-1))))
    return int(torch.unique(idx).numel())


@dataclass(repr=False)
class NodeTable(FieldsRepr):
    """One entry per node.

    Attributes:
        kind: ``(n,)`` int64, one of :data:`TRANSCODER` … :data:`LOGIT`.
        layer: ``(n,)`` int64 — the layer whose attention (Lorsa, attention error) or MLP
            (transcoder, MLP error) holds the node; ``-1`` for embeddings, ``n_layers`` for logits,
            the layer of the module for biases (``n_layers`` for the final norm / unembedding).
        pos: ``(n,)`` int64 token position (``-1`` for bias nodes, which sum over positions).
        index: ``(n,)`` int64 — feature / OV-head index, token id for embeddings and logits,
            index into ``bias_names`` for biases, ``-1`` for errors.
        activation: ``(n,)`` float — feature activation / head ``z`` (Lorsa §3.1) on the prompt,
            the logit's probability for logits, the error vector's norm for errors, 0 otherwise.
        bias_names: name of each bias node, e.g. ``"L2.mlp.b_dec"``.
        intervened: ``(n,)`` bool — the node was edited in the traced forward pass the graph is of
            (``attribute(rm, tracer=tracer)``: an ablated, scaled, steered or patched Lorsa head or
            transcoder feature, held at its edited value as a fixed input with no incoming edges); all
            False in the graph of a clean pass.
    """

    kind: torch.Tensor
    layer: torch.Tensor
    pos: torch.Tensor
    index: torch.Tensor
    activation: torch.Tensor
    bias_names: list[str]
    intervened: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool, device=HOST))

    def __post_init__(self) -> None:
        if self.intervened.numel() != self.kind.numel():  # the default (no node intervened), sized to the table
            self.intervened = torch.zeros(self.kind.numel(), dtype=torch.bool, device=HOST)

    def __len__(self) -> int:
        return int(self.kind.numel())

    def count(self, kind: int) -> int:
        return int((self.kind == kind).sum())

    def label(self, i: int) -> str:
        """A short readable name, e.g. ``lorsa L2 h17 @5``, ``tc L1 f301 @3``, ``bias L2.mlp.b_dec``."""
        k, layer, pos, idx = (int(t[i]) for t in (self.kind, self.layer, self.pos, self.index))
        if k == BIAS:
            return f"bias {self.bias_names[idx]}"
        if k in (MLP_ERROR, ATTN_ERROR):
            return f"{SHORT_NAMES[k]} L{layer} @{pos}"
        if k == EMBEDDING:
            return f"emb tok{idx} @{pos}"
        if k == LOGIT:
            return f"logit tok{idx}"
        return f"{SHORT_NAMES[k]} L{layer} {'h' if k == LORSA else 'f'}{idx} @{pos}"

    def attention_side(self) -> torch.Tensor:
        """``(n,)`` bool: the nodes of a layer's attention rather than its MLP — Lorsa heads, Lorsa errors and the
        biases the attention side adds (:data:`ATTENTION_BIAS`: ``L<l>.attn_norm.bias``, ``L<l>.lorsa.b_V`` /
        ``b_D``, ``L<l>.attn.b_V`` / ``b_O``). Where a picture puts a node on its layer's attention row."""
        out = (self.kind == LORSA) | (self.kind == ATTN_ERROR)
        for i in (self.kind == BIAS).nonzero().flatten().tolist():
            out[i] = ATTENTION_BIAS.match(self.bias_names[int(self.index[i])]) is not None
        return out

    def sites(self) -> torch.Tensor:
        """``(n,)`` int64 each node's site in the residual stream's order: embeddings 0, layer ``l``'s
        attention nodes (Lorsa heads, attention errors) ``2l + 1``, its MLP nodes (transcoder features,
        MLP errors) ``2l + 2``, logits after every layer; biases ``-1`` (no site: a source of every
        target). A target depends only on sources at an earlier site (:class:`BlockAdjacency`)."""
        # per kind (TRANSCODER … LOGIT) the site is mult·layer + offset: one gather of each, no mask per kind
        mult = torch.tensor(_SITE_MULT, dtype=torch.long, device=self.kind.device)[self.kind]
        offset = torch.tensor(_SITE_OFFSET, dtype=torch.long, device=self.kind.device)[self.kind]
        return mult.mul_(self.layer).add_(offset)

    def select(self, keep: torch.Tensor) -> NodeTable:
        """The nodes where the bool mask / index tensor ``keep`` selects."""
        return NodeTable(self.kind[keep], self.layer[keep], self.pos[keep], self.index[keep],
                         self.activation[keep], list(self.bias_names), self.intervened[keep])

    @staticmethod
    def cat(tables: list[NodeTable]) -> NodeTable:
        """The tables one after another, on the host (a node table lives on the CPU whatever the model's
        device)."""
        names = tables[0].bias_names if tables else []
        kind, layer, pos, index, activation, intervened = (
            torch.cat([getattr(t, f).to(HOST) for t in tables]) for f in
            ("kind", "layer", "pos", "index", "activation", "intervened"))
        return NodeTable(kind, layer, pos, index, activation, list(names), intervened)

    @staticmethod
    def make(kind: int, layer: torch.Tensor | int, pos: torch.Tensor, index: torch.Tensor | int,
             activation: torch.Tensor | None = None, bias_names: list[str] | None = None,
             intervened: torch.Tensor | None = None) -> NodeTable:
        """A table of ``pos.numel()`` nodes of one kind, on the host (tensors from any device are copied);
        ``intervened``: ``(n,)`` bool marks (default none)."""
        n = pos.numel()

        def full(v: torch.Tensor | int) -> torch.Tensor:
            if isinstance(v, torch.Tensor):
                return v.detach().to(HOST, torch.long).reshape(n)
            return torch.full((n,), v, dtype=torch.long, device=HOST)

        act = (torch.zeros(n, device=HOST) if activation is None
               else activation.detach().to(HOST, torch.float32).reshape(n))
        marks = (torch.zeros(n, dtype=torch.bool, device=HOST) if intervened is None
                 else intervened.detach().to(HOST, torch.bool).reshape(n))
        return NodeTable(torch.full((n,), kind, dtype=torch.long, device=HOST), full(layer), full(pos),
                         full(index), act, list(bias_names or []), marks)
