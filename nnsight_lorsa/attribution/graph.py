"""An attribution graph: its nodes (what each row/column of the adjacency is), the adjacency of
direct effects, and the values edges sum to.

Node order (as circuit-tracer, with Lorsa heads among the features and bias nodes added):
``[features | errors | embeddings | biases | logits]``, where *features* are, layer by layer,
the active Lorsa heads of the layer's attention then the active transcoder features of its MLP
(each sorted by position, then index). Features, Lorsa heads and logits are *targets* (they
have incoming edges); errors, embeddings and biases are sources only. The node kinds are the
constants :data:`TRANSCODER` … :data:`LOGIT` (also ``Graph.TRANSCODER`` …).

Saved as ``graph.safetensors`` (tensors) + ``graph.json`` (everything else); no pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .._repr import FieldsRepr
from .._typing import Float
from ..errors import CheckpointError, UnsupportedArchitectureError

#: node kinds (``NodeTable.kind``), with their Neuronpedia ``feature_type`` names
TRANSCODER, LORSA, MLP_ERROR, ATTN_ERROR, EMBEDDING, BIAS, LOGIT = range(7)
KIND_NAMES = ("cross layer transcoder", "lorsa", "mlp reconstruction error", "lorsa error",
              "embedding", "bias", "logit")
SHORT_NAMES = ("tc", "lorsa", "mlp_err", "attn_err", "emb", "bias", "logit")
#: where a graph, its node tables and its stored rows live, whatever the model's device: the host
#: (the frozen pass runs on the model's device; its rows are copied here as each batch is computed)
HOST = torch.device("cpu")


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

    def sites(self) -> torch.Tensor:
        """``(n,)`` int64 each node's site in the residual stream's order: embeddings 0, layer ``l``'s
        attention nodes (Lorsa heads, attention errors) ``2l + 1``, its MLP nodes (transcoder features,
        MLP errors) ``2l + 2``, logits after every layer; biases ``-1`` (no site: a source of every
        target). A target depends only on sources at an earlier site (:class:`BlockAdjacency`)."""
        k, layer = self.kind, self.layer
        site = torch.full_like(layer, -1)
        site[k == EMBEDDING] = 0
        attn = (k == LORSA) | (k == ATTN_ERROR)
        mlp = (k == TRANSCODER) | (k == MLP_ERROR)
        site[attn] = 2 * layer[attn] + 1
        site[mlp] = 2 * layer[mlp] + 2
        logit = k == LOGIT
        site[logit] = 2 * layer[logit] + 3
        return site

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


class BlockAdjacency:
    """An ``(n, n)`` adjacency stored by its causal blocks: only the entries that can be non-zero.

    A target's value in the frozen replacement model depends only on sources upstream of it: at an
    earlier site (:meth:`NodeTable.sites`; the residual stream is written in order) and at a position
    ``≤`` its own (causal attention), plus the bias nodes (no position; kept for every target).
    Everything else in circuit-tracer's dense ``n_nodes²`` matrix is a structural zero — the rows of
    errors, embeddings and biases, the columns of later layers and later positions: about 80 % of it
    on a 4-layer model. The target rows are grouped into *cells* of equal (site, position) — all rows
    of a cell have the same possible sources — with one dense ``(rows, possible sources)`` block per
    cell: ``4 B`` (fp32) per possible edge instead of ``4 B · n²``. A cell's columns (:meth:`cols`)
    are the sources at an earlier site ordered by (position, node) — so the columns of cell ``(s, p)``
    are a prefix of that order — then the bias nodes. Exact: every entry that could be non-zero is
    stored, and each row is checked as it is written to have nothing outside its block (else
    :class:`~nnsight_lorsa.errors.UnsupportedArchitectureError`); :meth:`dense` gives the ``(n, n)`` matrix.

    Args:
        site: ``(n,)`` int64 each node's site (:meth:`NodeTable.sites`: ``-1`` a source of every
            target); ``n`` nodes, sources first.
        pos: ``(n,)`` int64 each node's position.
        n_sources: the columns that can be sources (the first ``n_sources`` nodes).
        rows: ``(r,)`` int64 the node ids of the rows that will be written (targets).
        dtype: the edges' dtype.
    """

    def __init__(self, site: torch.Tensor, pos: torch.Tensor, n_sources: int, rows: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.n, self.n_sources, self.dtype = int(site.numel()), n_sources, dtype
        self._src_site, self._src_pos = site[:n_sources], pos[:n_sources]
        self._free = (self._src_site < 0).nonzero().flatten()  # biases: a source of every target
        rows = rows.long()
        row_site, row_pos = site[rows], pos[rows]
        key = row_site * (int(pos.max()) + 2 if self.n else 1) + row_pos
        uniq, cell = key.unique(return_inverse=True)
        self._cell_of_row = torch.full((self.n,), -1, dtype=torch.long, device=HOST)
        self._cell_of_row[rows] = cell
        order = cell.argsort(stable=True)
        counts = torch.bincount(cell, minlength=uniq.numel())
        self.cell_rows = list(rows[order].split(counts.tolist()))  # each cell's rows, ascending node ids
        self._slot = torch.zeros(self.n, dtype=torch.long, device=HOST)  # a row's place in its cell's block
        for r in self.cell_rows:
            self._slot[r] = torch.arange(r.numel(), device=HOST)
        starts = torch.cat([torch.zeros(1, dtype=torch.long, device=HOST), counts.cumsum(0)[:-1]])
        first = order[starts] if rows.numel() else order
        self.cell_site, self.cell_pos = row_site[first], row_pos[first]
        # per target site: the sources at earlier sites by (position, node); a cell takes a prefix
        self._upstream: dict[int, torch.Tensor] = {}
        k = torch.zeros(len(self.cell_rows), dtype=torch.long, device=HOST)
        for s in self.cell_site.unique().tolist():
            src = ((self._src_site >= 0) & (self._src_site < s)).nonzero().flatten()
            src = src[self._src_pos[src].argsort(stable=True)]
            self._upstream[s] = src
            at = (self.cell_site == s).nonzero().flatten()
            k[at] = torch.searchsorted(self._src_pos[src].contiguous(), self.cell_pos[at].contiguous(), right=True)
        self._prefix = k
        self.blocks: list[torch.Tensor | None] = [None] * len(self.cell_rows)

    # ------------------------------------------------------------------ structure
    def cols(self, cell: int) -> torch.Tensor:
        """``(c,)`` int64 the source columns of cell ``cell``'s block, in the block's order."""
        return torch.cat([self._upstream[int(self.cell_site[cell])][:int(self._prefix[cell])], self._free])

    def n_cols(self) -> torch.Tensor:
        """``(n_cells,)`` the number of columns of each cell's block (without building them)."""
        return self._prefix + self._free.numel()

    def entries(self) -> int:
        """Stored entries once every row is written (``Σ`` rows × columns over the cells)."""
        sizes = torch.tensor([r.numel() for r in self.cell_rows], dtype=torch.long, device=HOST)
        return int((sizes * self.n_cols()).sum())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks if b is not None)

    # ------------------------------------------------------------------ writing
    def write(self, rows: torch.Tensor, grads: Float[torch.Tensor, "b s"]) -> None:
        """Store ``grads[i]`` as row ``rows[i]`` (node ids of this adjacency's rows; ``grads``: the
        ``n_sources`` columns).

        Raises:
            UnsupportedArchitectureError: a row has a non-zero entry outside its block — an edge from a
                later position or site, which a causal decoder's frozen replacement model cannot have.
        """
        rows = rows.to(HOST, torch.long)
        g = grads.detach().to(HOST)  # the rows of a batch, from the model's device
        cells = self._cell_of_row[rows]
        if bool((cells < 0).any()) or g.shape[1] != self.n_sources:
            raise ValueError(f"rows {rows.tolist()} / {g.shape[1]} columns do not fit this adjacency")
        kept = 0
        for cell in cells.unique().tolist():
            at = (cells == cell).nonzero().flatten()
            cols = self.cols(cell)
            part = g[at[:, None], cols[None, :]]
            block = self.blocks[cell]
            if block is None:
                block = self.blocks[cell] = torch.zeros(self.cell_rows[cell].numel(), cols.numel(), dtype=self.dtype,
                                                        device=HOST)
            block[self._slot[rows[at]]] = part.to(self.dtype)
            kept += int(part.count_nonzero())
        if kept != int(g.count_nonzero()):  # a non-zero entry outside the blocks: find it, refuse the rows
            for i, cell in enumerate(cells.tolist()):
                outside = g[i].clone()
                outside[self.cols(cell)] = 0
                if bool(outside.any()):
                    src = int(outside.nonzero()[0])
                    raise UnsupportedArchitectureError(
                        f"attribution row of node {int(rows[i])} (site {int(self.cell_site[cell])}, position "
                        f"{int(self.cell_pos[cell])}) has an edge from source {src} (site {int(self._src_site[src])}, "
                        f"position {int(self._src_pos[src])}): later than the target. The full graph's block "
                        "storage assumes a causal decoder; sparse rows store any edge: "
                        "prune=PruneConfig(..., keep_mass=0.999)")

    # ------------------------------------------------------------------ reading
    def items(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(rows (r,), cols (c,), block (r, c))`` of every written cell: ``A[rows[i], cols[j]] = block[i, j]``."""
        for cell, block in enumerate(self.blocks):
            if block is not None:
                yield self.cell_rows[cell], self.cols(cell), block

    def dense(self) -> Float[torch.Tensor, "n n"]:
        """The ``(n, n)`` matrix (``4 B · n²`` at fp32; zeros outside the blocks)."""
        out = torch.zeros(self.n, self.n, dtype=self.dtype, device=HOST)
        for rows, cols, block in self.items():
            out[rows[:, None], cols[None, :]] = block
        return out

    def row_sums(self, rows: torch.Tensor, absolute: bool = False) -> Float[torch.Tensor, " r"]:
        """``(r,)`` float64 ``Σ_s A[t, s]`` (or ``Σ_s |A[t, s]|``) of the node ids ``rows``."""
        sums = torch.zeros(self.n, dtype=torch.float64, device=HOST)
        for r, _, block in self.items():
            sums[r] = (block.abs() if absolute else block).sum(1, dtype=torch.float64)
        return sums[rows.long()]

    def count_nonzero(self) -> int:
        return sum(int((b != 0).sum()) for b in self.blocks if b is not None)


GRAPH_FORMAT = "nnsight-lorsa-graph/1"


@dataclass(repr=False)
class Graph(FieldsRepr):
    """A frozen-Jacobian attribution graph of one prompt (Ameisen et al. 2025, *Circuit Tracing*).

    Attributes:
        tokens: ``(pos,)`` int64 input ids; ``prompt``: its text (if known).
        nodes: the :class:`NodeTable` (``[features | errors | embeddings | biases | logits]``).
        adjacency: ``(n_nodes, n_nodes)`` float32, ``adjacency[t, s]`` = direct effect of source
            ``s`` on target ``t``'s pre-activation (for logits: the demeaned logit) in the frozen
            replacement model. Rows of sources only (errors, embeddings, biases) are zero. The unpruned
            graph of :func:`.attribute.attribute` (full or budgeted) keeps only its causal blocks
            (:attr:`block_adjacency`, :class:`BlockAdjacency`: the entries that can be non-zero, ~20 % of
            ``n_nodes²`` on a 4-layer model); reading ``adjacency`` then raises
            :class:`~nnsight_lorsa.errors.DenseAdjacencyError`: the dense matrix (``4 B · n_nodes²`` at
            fp32 — 1.2 GB at 256 tokens of the embedded model) is built only by the explicit
            :meth:`densify`, after which the graph keeps it instead of the blocks. :meth:`edge_sum_error`,
            :meth:`summary`, :attr:`n_edges` and :meth:`save` read the blocks without it; :func:`.scores.prune`,
            :func:`.scores.graph_scores` and the exports densify. A pruned or loaded graph holds the dense
            matrix.
        values: ``(n_nodes,)`` the frozen model's value of each target (feature pre-activation,
            Lorsa head ``z_pre``, demeaned logit); NaN for source-only nodes. With every feature
            row computed, ``adjacency[t].sum() == values[t]`` (to fp32 rounding).
        logit_probs: ``(n_logits,)`` the target tokens' probabilities.
        feature_rows: bool ``(n_nodes,)`` — the rows that were computed (all features and logits
            unless ``max_feature_nodes`` cut the features).
        layout_ids: ``(n_nodes,)`` each node's index among all of the prompt's nodes
            (:class:`~.layout.Layout`; differs only where ``max_feature_nodes`` dropped features).
        meta: model name, layers replaced, settings (JSON-serialisable).
        residual: ``(n_nodes,)`` the part of each target's value carried by edges that are not in
            the graph (0 for a full graph; for a graph pruned while it was built — ``attribute(...,
            prune=PruneConfig(...))`` — the summed edges from dropped nodes and dropped entries).
        qk: QK tracing of the top Lorsa heads (``attribute(..., qk_heads=n)``; :func:`.qk.qk_for_graph`
            names the tensors), empty otherwise.
    """

    tokens: torch.Tensor
    nodes: NodeTable
    if TYPE_CHECKING:  # reads give the dense matrix (a property, below the class)
        adjacency: torch.Tensor
    else:  # the constructor takes either; blocks are densified on the first read
        adjacency: torch.Tensor | BlockAdjacency = field(repr=False)
    values: torch.Tensor
    logit_probs: torch.Tensor
    feature_rows: torch.Tensor
    layout_ids: torch.Tensor
    prompt: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    residual: torch.Tensor | None = None
    qk: dict[str, torch.Tensor] = field(default_factory=dict)

    #: the node kinds of ``nodes.kind`` (module constants of the same names), e.g. ``g.ids_of(Graph.LORSA)``
    TRANSCODER: ClassVar[int] = TRANSCODER
    LORSA: ClassVar[int] = LORSA
    MLP_ERROR: ClassVar[int] = MLP_ERROR
    ATTN_ERROR: ClassVar[int] = ATTN_ERROR
    EMBEDDING: ClassVar[int] = EMBEDDING
    BIAS: ClassVar[int] = BIAS
    LOGIT: ClassVar[int] = LOGIT

    def __post_init__(self) -> None:
        if self.residual is None:
            self.residual = torch.zeros(len(self.nodes), dtype=self._adjacency.dtype, device=HOST)

    def _hold(self, value: torch.Tensor | BlockAdjacency) -> None:
        """What ``adjacency`` holds: the dense matrix or the causal blocks."""
        self._adjacency: torch.Tensor | BlockAdjacency = value

    @property
    def block_adjacency(self) -> BlockAdjacency | None:
        """The adjacency's causal blocks (:class:`BlockAdjacency`) while the graph keeps them
        (a full graph of :func:`.attribute.attribute` until ``adjacency`` is first read), else None."""
        a = self._adjacency
        return None if isinstance(a, torch.Tensor) else a

    def densify(self) -> torch.Tensor:
        """The dense ``(n_nodes, n_nodes)`` adjacency, which the graph keeps from now on (:attr:`adjacency`
        reads it): built from the causal blocks (``4 B · n_nodes²`` at fp32, on the host; the blocks are
        dropped), or the matrix the graph already holds (a pruned or loaded graph; no copy)."""
        a = self._adjacency
        if not isinstance(a, torch.Tensor):
            a = a.dense()
            self._hold(a)
        return a

    @property
    def n_edges(self) -> int:
        """The number of non-zero edges (from the blocks, if kept: no dense matrix)."""
        a = self._adjacency
        return int((a != 0).sum()) if isinstance(a, torch.Tensor) else a.count_nonzero()

    def _row_sums(self, rows: torch.Tensor, absolute: bool) -> torch.Tensor:
        a = self._adjacency
        if isinstance(a, torch.Tensor):
            A = a[rows].double()
            return (A.abs() if absolute else A).sum(-1)
        return a.row_sums(rows, absolute)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def ids_of(self, kind: int) -> torch.Tensor:
        """Indices of the nodes of one kind (e.g. ``Graph.LORSA``)."""
        return (self.nodes.kind == kind).nonzero().flatten()

    @property
    def logit_ids(self) -> torch.Tensor:
        return self.ids_of(LOGIT)

    @property
    def feature_ids(self) -> torch.Tensor:
        """Feature-like nodes (transcoder features and Lorsa heads)."""
        return ((self.nodes.kind == TRANSCODER) | (self.nodes.kind == LORSA)).nonzero().flatten()

    def edge_sum_error(self, relative_to: str = "value") -> torch.Tensor:
        """The exactness check over the computed target rows: ``|Σ_s A[t, s] − value_t|`` divided by
        ``|value_t|`` (``relative_to="value"``) or by the row's mass ``Σ_s |A[t, s]|`` (+ ``|residual|``; ``"mass"``:
        the scale of fp rounding in a sum of terms that may cancel). ``(n_rows,)``, 0 up to rounding."""
        rows = self.feature_rows.nonzero().flatten()
        v = self.values[rows].double()
        assert self.residual is not None
        r = self.residual[rows].double()
        den = v.abs() if relative_to == "value" else self._row_sums(rows, True) + r.abs()
        return (self._row_sums(rows, False) + r - v).abs() / den.clamp_min(1e-12)

    # -------------------------------------------------------------- save/load
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``graph.safetensors`` + ``graph.json`` (+ ``checksums.json``) as ``directory``; returns it.

        Atomic (:func:`nnsight_lorsa._atomic.atomic_directory`): staged in a sibling and swapped in, so a
        crash leaves the previous graph there or this one, never one's tensors with the other's prompt.
        ``meta`` is checked before anything is written.

        Raises:
            ArgumentError: ``meta`` (or the prompt) is not JSON-serialisable (nothing is written).
        """
        from .._atomic import atomic_directory
        from ..errors import ArgumentError

        n = self.nodes
        try:
            info = json.dumps({"format": GRAPH_FORMAT, "prompt": self.prompt, "bias_names": n.bias_names,
                               "meta": self.meta}, indent=1)
        except (TypeError, ValueError, RecursionError) as e:
            raise ArgumentError(f"Graph.save: graph.meta must be JSON-serialisable (numbers, strings, lists, dicts); "
                                f"{type(e).__name__}: {e}; nothing was written") from e
        a = self._adjacency  # blocks: a dense copy for the file, not kept
        tensors = {"tokens": self.tokens, "adjacency": a.contiguous() if isinstance(a, torch.Tensor) else a.dense(),
                   "values": self.values,
                   "logit_probs": self.logit_probs, "feature_rows": self.feature_rows, "layout_ids": self.layout_ids,
                   "residual": self.residual,
                   "node_kind": n.kind, "node_layer": n.layer, "node_pos": n.pos, "node_index": n.index,
                   "node_activation": n.activation, "node_intervened": n.intervened.to(torch.uint8)}
        tensors.update({f"qk.{k}": v for k, v in self.qk.items()})
        with atomic_directory(directory) as stage:
            stage.save_tensors("graph.safetensors",
                               {k: v.contiguous().cpu() for k, v in tensors.items() if v is not None})
            stage.write_text("graph.json", info)
        return Path(directory)

    def push_to_hub(self, repo_id: str, *, metrics: Any = None, subfolder: str | None = None,
                    private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload with nnsight-lorsa") -> str:
        """Publish the graph to the Hugging Face Hub model repo ``repo_id`` (created if missing) in the Hub
        layout (:mod:`nnsight_lorsa.formats.hub`): what :meth:`save` writes (``graph.json`` +
        ``graph.safetensors`` + ``checksums.json``) and a model card ``README.md`` (the prompt, the node counts
        of :meth:`summary`, the replaced layers, ``metrics``, how to load it), written locally first through the
        atomic write path, then uploaded in one commit. ``Graph.load(repo_id)`` reads it back.

        Args:
            repo_id: ``"owner/name"``. metrics: for the card, e.g. ``{"replacement_score": r,
                "completeness_score": c}`` (:func:`~.scores.graph_scores`). subfolder: a folder of the repo
                (one per prompt, say); default its top. private: the visibility of a new repo. token: a Hub token.

        Returns:
            The commit's URL.

        Raises:
            ArgumentError: a ``repo_id`` that is not ``owner/name``; a bad ``subfolder``, ``private`` or
                ``commit_message``; ``metrics`` that are not metrics; ``meta`` not JSON-serialisable
                (nothing is uploaded).
            MissingDependencyError: ``huggingface_hub`` is not installed.
        """
        from ..formats.hub import check_push_args, graph_card, metrics_table, stage_and_push

        check_push_args(repo_id, subfolder, commit_message, "Graph.push_to_hub", private)
        table = metrics_table(metrics, where="Graph.push_to_hub")

        def write(folder: Path) -> None:
            self.save(folder)
            graph_card(folder, prompt=self.prompt, n_tokens=int(self.tokens.numel()), counts=self.summary(),
                       meta=self.meta, metrics_table=table, repo_id=repo_id, subfolder=subfolder)

        return stage_and_push(write, repo_id, subfolder=subfolder, private=private, token=token,
                              commit_message=commit_message, where="Graph.push_to_hub")

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, revision: str | None = None, subfolder: str | None = None,
             local_files_only: bool = False) -> Graph:
        """Read a graph written by :meth:`save` (or :meth:`push_to_hub`), every field checked before the graph
        is built.

        ``directory``: a local directory, or a Hugging Face repo id ``"owner/name"`` (``"owner/name:folder"``)
        that is no local path: its ``graph.json``, ``graph.safetensors``, ``checksums.json`` and card are
        downloaded (``huggingface_hub.snapshot_download`` with ``revision``, ``subfolder``,
        ``local_files_only``) and read as a local directory. ``subfolder`` is also honoured locally.

        Raises:
            CheckpointError: a missing or unreadable file, another format, a missing tensor, a tensor
                of the wrong dtype or shape, non-finite values, node kinds / layers / positions /
                indices outside their ranges, probabilities outside [0, 1], or ``graph.json`` fields
                of the wrong type — naming the file and the key; a file that differs from what
                ``checksums.json`` records (truncated, altered); a repo id that could not be fetched.
        """
        from .._atomic import check, manifest_of, resolve
        from ..formats.files import load_safetensors, read_json_object, resolve_checkpoint_dir
        from ..formats.hub import CARD, looks_like_repo_id

        if looks_like_repo_id(directory):
            directory = resolve_checkpoint_dir(
                directory, allow_patterns=["graph.json", "graph.safetensors", "checksums.json", CARD],
                subfolder=subfolder, revision=revision, local_files_only=local_files_only)
        elif subfolder:
            directory = Path(directory) / subfolder
        d = resolve(directory)  # `<directory>.old` when a save was killed between its two renames
        entries = manifest_of(d)
        info_path, tensors_path = d / "graph.json", d / "graph.safetensors"
        for path in (info_path, tensors_path):
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (not a directory written by Graph.save)")
        info = read_json_object(info_path)
        if info.get("format") != GRAPH_FORMAT:
            raise CheckpointError(f"{info_path}: key 'format' is {info.get('format')!r}, expected {GRAPH_FORMAT!r}")
        prompt, bias_names, meta = info.get("prompt", ""), info.get("bias_names", []), info.get("meta")
        if not isinstance(prompt, str):
            raise CheckpointError(f"{info_path}: key 'prompt' must be a string, got {prompt!r}")
        if not isinstance(bias_names, list) or not all(isinstance(b, str) for b in bias_names):
            raise CheckpointError(f"{info_path}: key 'bias_names' must be a list of strings, got {bias_names!r}")
        if not isinstance(meta, dict):
            raise CheckpointError(f"{info_path}: key 'meta' must be an object, got {meta!r}")
        t = load_safetensors(tensors_path)
        _check_graph_tensors(tensors_path, t)
        marks = t.get("node_intervened")  # absent from graphs saved before intervened-pass attribution: none
        nodes = NodeTable(t["node_kind"], t["node_layer"], t["node_pos"], t["node_index"], t["node_activation"],
                          list(bias_names), torch.zeros(0, dtype=torch.bool, device=HOST) if marks is None
                          else marks.bool())
        if int((nodes.kind == BIAS).sum()) != len(nodes.bias_names):
            raise CheckpointError(f"{info_path}: key 'bias_names' has {len(nodes.bias_names)} names for "
                                  f"{int((nodes.kind == BIAS).sum())} bias nodes")
        graph = cls(tokens=t["tokens"], nodes=nodes, adjacency=t["adjacency"], values=t["values"],
                    logit_probs=t["logit_probs"], feature_rows=t["feature_rows"].bool(),
                    layout_ids=t["layout_ids"], residual=t.get("residual"), prompt=prompt, meta=meta,
                    qk={k[3:]: v for k, v in t.items() if k.startswith("qk.")})
        if entries is not None:  # after the field checks (their errors name the key), before returning
            check(d, entries)
        return graph

    def summary(self) -> dict[str, int]:
        """Node counts by kind and the number of non-zero edges."""
        k = self.nodes.kind
        return {"features": int((k == TRANSCODER).sum()), "lorsa_heads": int((k == LORSA).sum()),
                "errors": int(((k == MLP_ERROR) | (k == ATTN_ERROR)).sum()), "embeddings": int((k == EMBEDDING).sum()),
                "biases": int((k == BIAS).sum()), "logits": int((k == LOGIT).sum()),
                "edges": self.n_edges}


def _get_adjacency(self: Graph) -> torch.Tensor:
    from ..errors import DenseAdjacencyError

    a = self._adjacency
    if not isinstance(a, torch.Tensor):  # never densified behind the caller's back
        mib = a.n * a.n * a.dtype.itemsize / 2**20
        raise DenseAdjacencyError(
            f"graph.adjacency: this graph keeps only its causal blocks ({a.n} nodes, {a.nbytes / 2**20:.1f} MiB); "
            f"the dense {a.n}x{a.n} matrix takes {mib:.1f} MiB: call graph.densify() to build and keep it, or read "
            "graph.block_adjacency (graph.edge_sum_error(), summary(), n_edges and save() need neither)")
    return a


def _set_adjacency(self: Graph, value: torch.Tensor | BlockAdjacency) -> None:
    self._hold(value)


# ``Graph.adjacency`` is a dataclass field (the constructor's ``adjacency=``) read through this property
Graph.adjacency = property(_get_adjacency, _set_adjacency,  # type: ignore[assignment,method-assign]
                           doc="The dense ``(n_nodes, n_nodes)`` adjacency the graph holds (a graph that keeps "
                               "only its causal blocks raises DenseAdjacencyError: Graph.densify(); see the class).")


_GRAPH_INTS = ("tokens", "layout_ids", "node_kind", "node_layer", "node_pos", "node_index")
_GRAPH_FLOATS = ("adjacency", "values", "logit_probs", "node_activation", "residual")


def _check_graph_tensors(path: Path, t: dict[str, torch.Tensor]) -> None:
    """:meth:`Graph.load`'s tensor checks (module docstring of :class:`Graph`): dtypes, shapes, ranges."""
    def bad(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {key!r} {why}")

    for key in (*_GRAPH_INTS, *_GRAPH_FLOATS, "feature_rows", "node_intervened"):
        if key not in t:
            if key in ("residual", "node_intervened"):  # optional: older files
                continue
            raise bad(key, "is missing")
        v = t[key]
        if v.dim() != (2 if key == "adjacency" else 1):
            raise bad(key, f"has shape {tuple(v.shape)}; expected {'(n, n)' if key == 'adjacency' else 'one axis'}")
        if key in _GRAPH_INTS and (v.is_floating_point() or v.dtype == torch.bool):
            raise bad(key, f"has dtype {v.dtype}; expected integers")
        if key in _GRAPH_FLOATS and not v.is_floating_point():
            raise bad(key, f"has dtype {v.dtype}; expected floats")
        if key in ("feature_rows", "node_intervened") and (v.is_floating_point()
                                                           or not bool(((v == 0) | (v == 1)).all())):
            raise bad(key, f"has dtype {v.dtype} / values other than 0 and 1; expected booleans")
    n, kind = t["node_kind"].numel(), t["node_kind"]
    for key in ("values", "feature_rows", "layout_ids", "residual", "node_layer", "node_pos", "node_index",
                "node_activation", "node_intervened"):
        if key in t and t[key].numel() != n:
            raise bad(key, f"has {t[key].numel()} entries for {n} nodes")
    if tuple(t["adjacency"].shape) != (n, n):
        raise bad("adjacency", f"has shape {tuple(t['adjacency'].shape)}; expected ({n}, {n}) for {n} nodes")
    for key in ("adjacency", "logit_probs", "node_activation", "residual"):
        if key in t and not bool(torch.isfinite(t[key]).all()):
            raise bad(key, "has non-finite values (NaN/inf)")
    values, rows = t["values"], t["feature_rows"].bool()
    if bool(torch.isinf(values).any()) or bool(values[rows].isnan().any()):
        raise bad("values", "has infinite values, or NaN at computed rows")
    if not bool(((kind >= 0) & (kind < len(KIND_NAMES))).all()):
        raise bad("node_kind", f"has kinds outside [0, {len(KIND_NAMES)})")
    layer, pos, n_pos = t["node_layer"], t["node_pos"], t["tokens"].numel()
    logits = kind == LOGIT
    top = int(layer[logits].max()) if bool(logits.any()) else int(layer.max()) if n else -1
    if bool(logits.any()) and bool((layer[logits] != top).any()):
        raise bad("node_layer", "differs between logit nodes")
    if not bool(((layer >= -1) & (layer <= top)).all()) or bool((layer[kind == EMBEDDING] != -1).any()):
        raise bad("node_layer", f"has layers outside [-1, {top}] (embeddings -1, logits {top})")
    bias = kind == BIAS
    if bool((pos[bias] != -1).any()) or not bool(((pos[~bias] >= 0) & (pos[~bias] < n_pos)).all()):
        raise bad("node_pos", f"has positions outside [0, {n_pos}) (-1 only for bias nodes)")
    if bool((t["node_index"] < -1).any()) or bool((t["tokens"] < 0).any()) or bool((t["layout_ids"] < 0).any()):
        raise bad("node_index" if bool((t["node_index"] < -1).any()) else
                  "tokens" if bool((t["tokens"] < 0).any()) else "layout_ids", "has negative entries")
    for key, v in t.items():
        if key.startswith("qk.") and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise bad(key, "has non-finite values (NaN/inf)")
    probs = t["logit_probs"]
    if probs.numel() != int(logits.sum()) or not bool(((probs >= 0) & (probs <= 1)).all()):
        raise bad("logit_probs", f"must hold one probability in [0, 1] per logit node ({int(logits.sum())})")
