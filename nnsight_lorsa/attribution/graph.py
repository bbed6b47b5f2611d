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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .._checks import is_int
from .._placement import is_index_dtype
from .._repr import FieldsRepr
from .._typing import Float, Int
from ..errors import ArgumentError, CheckpointError
from .blocks import BlockAdjacency
from .nodes import (  # the node kinds, HOST and NodeTable live in .nodes; imported from here too
    ATTN_ERROR,
    BIAS,
    EMBEDDING,
    HOST,
    KIND_NAMES,
    LOGIT,
    LORSA,
    MLP_ERROR,
    TRANSCODER,
    NodeTable,
)

GRAPH_FORMAT = "nnsight-lorsa-graph/1"
#: what a wrong-kind ``graph`` argument is told (``_checks.check_instance``)
GRAPH_HINT = " (attribute(replacement, prompt) returns one; Graph.load(directory) reads a saved one)"


@dataclass(repr=False)
class Graph(FieldsRepr):
    """A frozen-Jacobian attribution graph of one prompt (Ameisen et al. 2025, *Circuit Tracing*).

    Attributes:
        tokens: ``(pos,)`` int64 input ids; ``prompt``: its text (if known).
        nodes: the :class:`NodeTable` (``[features | errors | embeddings | biases | logits]``).
        adjacency: ``(n_nodes, n_nodes)`` float32, ``adjacency[t, s]`` = direct effect of source
            ``s`` on target ``t``'s pre-activation (for logits: the demeaned logit) in the frozen
            replacement model. Rows of sources only (errors, embeddings, biases) are zero. Every graph of
            :func:`.attribute.attribute` (full or budgeted, and pruned while built, with or without a budget)
            keeps only its causal blocks
            (:attr:`block_adjacency`, :class:`BlockAdjacency`: the entries that can be non-zero, ~20 % of
            ``n_nodes²`` on a 4-layer model); reading ``adjacency`` then raises
            :class:`~nnsight_lorsa.errors.DenseAdjacencyError`: the dense matrix (``4 B · n_nodes²`` at
            fp32 — 1.2 GB at 256 tokens of the embedded model) is built only by the explicit
            :meth:`densify`, after which the graph keeps it instead of the blocks. :meth:`edge_sum_error`,
            :meth:`summary`, :attr:`n_edges`, :meth:`save` / :meth:`load` (the blocks as blocks),
            :func:`.scores.prune`, :func:`.scores.graph_scores`, the exports, the plot and the checks read the
            blocks without it (:meth:`coo`: the non-zero edges, :meth:`edge_values`: chosen edges).
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

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias nodes
    are ours).
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
        (a full graph of :func:`.attribute.attribute` until ``adjacency`` is first read), else None.

        Source: ours (the causal-block storage, :class:`BlockAdjacency`).
        """
        a = self._adjacency
        return None if isinstance(a, torch.Tensor) else a

    def densify(self) -> torch.Tensor:
        """The dense ``(n_nodes, n_nodes)`` adjacency, which the graph keeps from now on (:attr:`adjacency`
        reads it): built from the causal blocks (``4 B · n_nodes²`` at fp32, on the host; the blocks are
        dropped), or the matrix the graph already holds (a densified or loaded graph; no copy).

        Source: ours (the causal-block storage, :class:`BlockAdjacency`).
        """
        a = self._adjacency
        if not isinstance(a, torch.Tensor):
            a = a.dense()
            self._hold(a)
        return a

    def coo(self) -> tuple[Int[torch.Tensor, " k"], Int[torch.Tensor, " k"], Float[torch.Tensor, " k"]]:
        """``(target, source, value)`` of the ``k`` non-zero edges in row-major order (target ascending, then
        source; int64, int64, the adjacency's dtype) — ``adjacency.nonzero()`` and its values, the same
        tensors whether the graph keeps its causal blocks (read from them: ``20 B · k``, no ``n_nodes²``
        matrix; :meth:`BlockAdjacency.coo`) or the dense matrix. What :mod:`.scores` computes on.

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
        a = self._adjacency
        if isinstance(a, torch.Tensor):
            t, s = a.nonzero(as_tuple=True)
            return t, s, a[t, s]
        return a.coo()

    def edge_values(self, targets: Int[torch.Tensor, "..."], sources: Int[torch.Tensor, "..."]
                    ) -> Float[torch.Tensor, "..."]:
        """``adjacency[targets, sources]`` (node ids; the two broadcast together, e.g. ``rows[:, None]`` and
        ``cols[None, :]`` for a sub-matrix), in the adjacency's dtype — from the causal blocks if the graph
        keeps them (:meth:`BlockAdjacency.gather`: memory of the result, no ``n_nodes²`` matrix). The ids may be on
        any device (a graph lives on the host; the result does too), like the blocks' path.

        Raises:
            ArgumentError: ``targets`` / ``sources`` not integer tensors, or holding an id outside ``[0, n_nodes)``
                (a negative id, one past the last or a fractional one read another node's edge, or 0, without a
                word).

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
        for name, ids in (("targets", targets), ("sources", sources)):
            if not isinstance(ids, torch.Tensor) or not is_index_dtype(ids.dtype):
                got = f"a {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else f"a {type(ids).__name__}"
                raise ArgumentError(f"Graph.edge_values: {name} must be an integer tensor of node ids, got {got}")
            if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.n_nodes):
                raise ArgumentError(f"Graph.edge_values: {name} hold node ids from {int(ids.min())} to "
                                    f"{int(ids.max())}; a graph of {self.n_nodes} nodes has ids in [0, {self.n_nodes})")
        a = self._adjacency
        if isinstance(a, torch.Tensor):
            return a[targets.to(a.device, torch.long), sources.to(a.device, torch.long)]
        return a.gather(targets, sources)

    @property
    def n_edges(self) -> int:
        """The number of non-zero edges (from the blocks, if kept: no dense matrix).

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
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
        """Number of nodes ``n`` (rows/columns of the ``(n, n)`` adjacency).

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
        return len(self.nodes)

    def ids_of(self, kind: int) -> torch.Tensor:
        """Indices of the nodes of one kind (e.g. ``Graph.LORSA``): ``(n_kind,)`` int64, ascending.

        Raises:
            ArgumentError: ``kind`` not one of the kinds (``Graph.TRANSCODER`` … ``Graph.LOGIT``, ints 0–6): a name
                such as ``"lorsa"`` was a raw ``AttributeError``, an int past the kinds an empty result.

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
        if not is_int(kind) or not 0 <= kind < len(KIND_NAMES):
            raise ArgumentError(f"Graph.ids_of(kind=...) must be one of the node kinds Graph.TRANSCODER, LORSA, "
                                f"MLP_ERROR, ATTN_ERROR, EMBEDDING, BIAS, LOGIT (ints 0–{len(KIND_NAMES) - 1}), got "
                                f"{kind!r}")
        return (self.nodes.kind == kind).nonzero().flatten()

    @property
    def logit_ids(self) -> torch.Tensor:
        """Node indices of the logit nodes: ``(n_logits,)`` int64 (:meth:`ids_of` ``LOGIT``).

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
        return self.ids_of(LOGIT)

    @property
    def feature_ids(self) -> torch.Tensor:
        """Feature-like nodes (transcoder features and Lorsa heads): ``(n_features,)`` int64 node indices, ascending.

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
        return ((self.nodes.kind == TRANSCODER) | (self.nodes.kind == LORSA)).nonzero().flatten()

    def edge_sum_error(self, relative_to: str = "value") -> torch.Tensor:
        """The exactness check over the computed target rows: ``|Σ_s A[t, s] − value_t|`` divided by
        ``|value_t|`` (``relative_to="value"``) or by the row's mass ``Σ_s |A[t, s]|`` (+ ``|residual|``; ``"mass"``:
        the scale of fp rounding in a sum of terms that may cancel). ``(n_rows,)``, 0 up to rounding.

        Raises:
            ArgumentError: ``relative_to`` neither ``"value"`` nor ``"mass"`` (any other was read as ``"mass"``).

        Source: ours (bias nodes make a node's incoming edges sum to its value; circuit-tracer has no bias nodes).
        """
        if not isinstance(relative_to, str) or relative_to not in ("value", "mass"):
            raise ArgumentError(f"Graph.edge_sum_error(relative_to=...) must be 'value' or 'mass', got {relative_to!r}")
        rows = self.feature_rows.nonzero().flatten()
        v = self.values[rows].double()
        assert self.residual is not None
        r = self.residual[rows].double()
        den = v.abs() if relative_to == "value" else self._row_sums(rows, True) + r.abs()
        return (self._row_sums(rows, False) + r - v).abs() / den.clamp_min(1e-12)

    # -------------------------------------------------------------- save/load
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``graph.safetensors`` + ``graph.json`` (+ ``checksums.json``) as ``directory``; returns it.

        The adjacency is written as the graph holds it: the dense ``(n_nodes, n_nodes)`` matrix (tensor
        ``adjacency``), or the causal blocks (:meth:`BlockAdjacency.to_tensors`: ``adjacency_rows``,
        ``adjacency_blocks`` and the number of sources; the blocks' bytes, no ``n_nodes²`` copy), which
        :meth:`load` gives back as blocks.

        Atomic (:func:`nnsight_lorsa._atomic.atomic_directory`): staged in a sibling and swapped in, so a
        crash leaves the previous graph there or this one, never one's tensors with the other's prompt.
        ``meta`` is checked before anything is written.

        Raises:
            ArgumentError: ``meta`` (or the prompt) is not JSON-serialisable, or ``directory`` not a str /
                ``os.PathLike`` (nothing is written).

        Source: ours (the graph's files: safetensors + JSON, no pickle).
        """
        from .._atomic import atomic_directory
        from ..errors import ArgumentError
        from ..formats.files import check_path

        check_path(directory, "Graph.save", "a directory")
        n = self.nodes
        try:
            info = json.dumps({"format": GRAPH_FORMAT, "prompt": self.prompt, "bias_names": n.bias_names,
                               "meta": self.meta}, indent=1)
        except (TypeError, ValueError, RecursionError) as e:
            raise ArgumentError(f"Graph.save: graph.meta must be JSON-serialisable (numbers, strings, lists, dicts); "
                                f"{type(e).__name__}: {e}; nothing was written") from e
        a = self._adjacency  # blocks: stored as blocks (their rows and values), never as the n² matrix
        adjacency = {"adjacency": a.contiguous()} if isinstance(a, torch.Tensor) else a.to_tensors()
        tensors = {"tokens": self.tokens, **adjacency, "values": self.values,
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

        Source: ours (the graph's files: safetensors + JSON, no pickle).
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
            ArgumentError: ``revision`` with a local path; a hub ``subfolder`` that leaves the repo; ``directory``
                not a str / ``os.PathLike``; ``subfolder`` / ``revision`` not None or a str, ``local_files_only`` not
                a bool (:func:`~nnsight_lorsa.formats.files.check_hub_args`).

        Source: ours (the graph's files: safetensors + JSON, no pickle).
        """
        from .._atomic import check, manifest_of, resolve
        from ..formats.files import (
            check_hub_args,
            check_path,
            load_safetensors,
            read_json_object,
            refuse_local_revision,
            resolve_checkpoint_dir,
        )
        from ..formats.hub import CARD, looks_like_repo_id

        check_path(directory, "Graph.load")
        check_hub_args("Graph.load", subfolder, revision, local_files_only)
        if looks_like_repo_id(directory):
            directory = resolve_checkpoint_dir(
                directory, allow_patterns=["graph.json", "graph.safetensors", "checksums.json", CARD],
                subfolder=subfolder, revision=revision, local_files_only=local_files_only)
        else:
            refuse_local_revision(directory, revision, "Graph.load: ")
            if subfolder:
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
        if "adjacency" in t:
            adjacency: torch.Tensor | BlockAdjacency = t["adjacency"]
        else:
            try:
                adjacency = BlockAdjacency.from_tensors(nodes, t)
            except ValueError as e:
                raise CheckpointError(f"{tensors_path}: {e}") from e
        graph = cls(tokens=t["tokens"], nodes=nodes, adjacency=adjacency,  # type: ignore[arg-type]
                    values=t["values"],
                    logit_probs=t["logit_probs"], feature_rows=t["feature_rows"].bool(),
                    layout_ids=t["layout_ids"], residual=t.get("residual"), prompt=prompt, meta=meta,
                    qk={k[3:]: v for k, v in t.items() if k.startswith("qk.")})
        if entries is not None:  # after the field checks (their errors name the key), before returning
            check(d, entries)
        return graph

    def summary(self) -> dict[str, int]:
        """Node counts by kind and the number of non-zero edges.

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias
        nodes are ours).
        """
        k = self.nodes.kind
        return {"features": int((k == TRANSCODER).sum()), "lorsa_heads": int((k == LORSA).sum()),
                "errors": int(((k == MLP_ERROR) | (k == ATTN_ERROR)).sum()), "embeddings": int((k == EMBEDDING).sum()),
                "biases": int((k == BIAS).sum()), "logits": int((k == LOGIT).sum()),
                "edges": self.n_edges}


def _get_adjacency(self: Graph) -> torch.Tensor:
    """The dense ``(n, n)`` adjacency (row = target, column = source). Raises
    :class:`~nnsight_lorsa.errors.DenseAdjacencyError` on a graph that keeps only its causal blocks.

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (node order; bias nodes
    are ours).
    """
    from ..errors import DenseAdjacencyError

    a = self._adjacency
    if not isinstance(a, torch.Tensor):  # never densified behind the caller's back
        mib = a.n * a.n * a.dtype.itemsize / 2**20
        raise DenseAdjacencyError(
            f"graph.adjacency: this graph keeps only its causal blocks ({a.n} nodes, {a.nbytes / 2**20:.1f} MiB); "
            f"the dense {a.n}x{a.n} matrix takes {mib:.1f} MiB: call graph.densify() to build and keep it, or read "
            "graph.block_adjacency / graph.coo() / graph.edge_values(t, s) (edge_sum_error(), summary(), n_edges, "
            "save(), prune(), graph_scores() and the exports need none of them)")
    return a


def _set_adjacency(self: Graph, value: torch.Tensor | BlockAdjacency) -> None:
    self._hold(value)


# ``Graph.adjacency`` is a dataclass field (the constructor's ``adjacency=``) read through this property
Graph.adjacency = property(_get_adjacency, _set_adjacency,  # type: ignore[assignment,method-assign]
                           doc="The dense ``(n_nodes, n_nodes)`` adjacency the graph holds (a graph that keeps "
                               "only its causal blocks raises DenseAdjacencyError: Graph.densify(); see the class).")


_GRAPH_INTS = ("tokens", "layout_ids", "node_kind", "node_layer", "node_pos", "node_index")
_GRAPH_FLOATS = ("adjacency", "values", "logit_probs", "node_activation", "residual")
_BLOCK_KEYS = ("adjacency_rows", "adjacency_blocks", "adjacency_sources")


def _check_graph_tensors(path: Path, t: dict[str, torch.Tensor]) -> None:
    """:meth:`Graph.load`'s tensor checks (module docstring of :class:`Graph`): dtypes, shapes, ranges."""
    def bad(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {key!r} {why}")

    blocks = "adjacency" not in t and "adjacency_blocks" in t  # an adjacency saved by its causal blocks
    for key in (*_GRAPH_INTS, *_GRAPH_FLOATS, "feature_rows", "node_intervened", *(_BLOCK_KEYS if blocks else ())):
        if key not in t:
            if key in ("residual", "node_intervened") or (key == "adjacency" and blocks):  # optional: older files
                continue
            raise bad(key, "is missing")
        if key in _BLOCK_KEYS:
            if t[key].dim() != 1 or t[key].is_floating_point() != (key == "adjacency_blocks"):
                raise bad(key, f"has shape {tuple(t[key].shape)} / dtype {t[key].dtype}; expected one axis of "
                               f"{'floats' if key == 'adjacency_blocks' else 'integers'}")
            continue
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
    if blocks:
        rows, ns = t["adjacency_rows"], t["adjacency_sources"]
        if ns.numel() != 1 or not 0 <= int(ns) <= n:
            raise bad("adjacency_sources", f"must hold one number of sources in [0, {n}]")
        if bool(((rows < 0) | (rows >= n)).any()) or rows.unique().numel() != rows.numel():
            raise bad("adjacency_rows", f"must hold distinct node ids in [0, {n})")
    elif tuple(t["adjacency"].shape) != (n, n):
        raise bad("adjacency", f"has shape {tuple(t['adjacency'].shape)}; expected ({n}, {n}) for {n} nodes")
    for key in ("adjacency", "adjacency_blocks", "logit_probs", "node_activation", "residual"):
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
