"""Every bad argument, misuse or malformed graph ends in a named error of ours (``nnsight_lorsa.errors``) that
says what and where — never a bare ``ValueError`` / ``TypeError`` / ``RuntimeError`` / ``IndexError`` /
``NotImplementedError`` (docs/reliability.md, "Where the checks live").

Two halves: each raise that was a built-in one, reached through the public API and asserted as the named
class (which still subclasses the built-in it replaced, so ``except ValueError`` callers keep working); and a
static guard (:func:`builtin_raises`) that parses every module of the package and fails on a ``raise`` of a
built-in exception class outside :data:`ALLOWED`.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import keyword
from pathlib import Path

import pytest
import torch
from helpers import attribution_setup, random_ids, rm, tiny_tokenizer, tiny_training_setup
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import errors

PACKAGE = Path(__file__).resolve().parents[1] / "nnsight_lorsa"
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------------------------- static guard
#: built-in exception classes a module of the package may raise, where (``file:function``) and why
ALLOWED = {
    # the module ``__getattr__`` protocol (PEP 562): anything else breaks ``hasattr`` / ``getattr(m, n, default)``
    "__init__.py:__getattr__": "AttributeError",
    # a SIGINT handler re-raises the user's own interrupt (Ctrl-C), after the step it let finish
    "demo.py:_stop_at_step_end.guarded": "KeyboardInterrupt",
    "demo.py:_stop_at_step_end.on_sigint": "KeyboardInterrupt",
    # internal helper of the gate uninstall, which checks the child first: the dict protocol's KeyError
    # (tests/adapters/test_transformers_internals.py expects it); no user argument reaches it
    "adapters/transformers_internals.py:remove_child": "KeyError",
    # internal invariant: the rows come from the attribution's RowScheduler, never from a user
    # (tests/attribution/test_attribution.py expects the IndexError)
    "attribution/replacement.py:FrozenReplacement.objective": "IndexError",
}
#: every exception class Python defines (``ValueError``, ``KeyError``, ``OSError``, ``Exception``, …)
BUILTIN_EXCEPTIONS = frozenset(n for n, v in vars(builtins).items()
                               if isinstance(v, type) and issubclass(v, BaseException))


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _is_abstract_stub(fn: ast.AST) -> bool:
    """A method whose body is only (a docstring and) a bare ``raise NotImplementedError``: an abstract
    method of a base class that its subclasses override (no user argument reaches it)."""
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Name)
            and body[0].exc.id == "NotImplementedError")


def builtin_raises(root: Path = PACKAGE, allowed: dict[str, str] = ALLOWED) -> list[str]:
    """``file:line: function: Class`` for each ``raise`` of a built-in exception class outside ``allowed``
    (``file:function``: class) and outside abstract stubs (:func:`_is_abstract_stub`). ``raise`` alone (a
    re-raise) and ``raise e`` (an exception object) are not class raises."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()

        def visit(node: ast.AST, scope: tuple[ast.AST, ...], rel: str = rel) -> None:
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN_EXCEPTIONS:
                    name = ".".join(s.name for s in scope if isinstance(s, SCOPES))
                    if allowed.get(f"{rel}:{name}") != exc.id and not (scope and _is_abstract_stub(scope[-1])):
                        found.append(f"{rel}:{node.lineno}: {name or '<module>'}: {exc.id}")
            inner = (*scope, node) if isinstance(node, SCOPES) else scope
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(ast.parse(path.read_text(encoding="utf-8")), ())
    return found


def test_no_module_raises_a_builtin_exception_class():
    found = builtin_raises()
    assert not found, ("raises of built-in exception classes (raise the fitting class of nnsight_lorsa.errors — "
                       "ArgumentError is a TypeError and a ValueError — or allow-list it with the reason):\n"
                       + "\n".join(found))


def test_every_allowed_raise_still_exists():
    """The allow-list holds no stale entry: each names a raise of that class there (a converted raise leaves it)."""
    raw = {f"{f.split(':')[0]}:{f.split(': ')[1]}": f.split(": ")[2] for f in builtin_raises(allowed={})}
    assert {k: v for k, v in ALLOWED.items() if raw.get(k) != v} == {}


def test_the_guard_finds_a_builtin_raise(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError(f'bad {x}')\n"          # found
        "    raise KeyError\n"                           # found (no call)
        "class C:\n"
        "    def stub(self):\n"
        "        '''abstract'''\n"
        "        raise NotImplementedError\n"             # an abstract stub: allowed
        "    def g(self):\n"
        "        try:\n"
        "            pass\n"
        "        except OSError as e:\n"
        "            raise\n"                             # a re-raise: not a class raise
        "        raise MyError('x')\n"                    # not a built-in
        "    def h(self, x):\n"
        "        if x:\n"
        "            raise NotImplementedError('no')\n"  # not a stub: found
        "        return x\n")
    assert builtin_raises(tmp_path / "pkg", {}) == ["m.py:3: f: ValueError", "m.py:4: f: KeyError",
                                                "m.py:17: C.h: NotImplementedError"]


# -------------------------------------------------------------------------------- attribution: graph, options
@pytest.fixture(scope="module")
def graph():
    from nnsight_lorsa.attribution import attribute, prune

    model, _, lorsas, tcs = attribution_setup("llama")
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 7, seed=5)[0], batch_size=48)
    return model, lorsas, tcs, g, prune(g)


def test_export_refuses_a_graph_without_logit_nodes(graph):
    from nnsight_lorsa.attribution import to_neuronpedia
    from nnsight_lorsa.attribution.graph import LOGIT

    _, _, _, g, pr = graph
    kind = torch.where(g.nodes.kind == LOGIT, torch.zeros_like(g.nodes.kind), g.nodes.kind)
    no_logits = copy.copy(g)  # the same graph (its blocks shared), its logit nodes relabelled
    no_logits.nodes = dataclasses.replace(g.nodes, kind=kind)
    with pytest.raises(errors.ArgumentError, match="no logit nodes"):
        to_neuronpedia(no_logits, pr, slug="x")


@FAST
@given(st.integers(-3, 3), st.booleans())
def test_export_refuses_a_prune_result_of_another_graph(graph, cut, edge):
    from nnsight_lorsa.attribution import to_neuronpedia

    _, _, _, g, pr = graph
    if edge:  # a node id outside the graph in the edge index
        e = pr.edge_index.clone()
        e[0, 0] = g.n_nodes + abs(cut) if cut >= 0 else cut
        bad = dataclasses.replace(pr, edge_index=e)
    else:  # a node mask of another length
        bad = dataclasses.replace(pr, node_mask=torch.ones(g.n_nodes + (cut or 1), dtype=torch.bool))
    with pytest.raises(errors.ArgumentError, match="do not fit a graph"):
        to_neuronpedia(g, bad, slug="x")


@FAST
@given(st.text(min_size=1, max_size=12))
def test_render_html_refuses_a_node_it_did_not_draw(graph, clicked):
    from nnsight_lorsa.viz import render_html

    _, _, _, g, pr = graph
    with pytest.raises(errors.ArgumentError, match="not an exported node"):
        render_html(g, pr, clicked="no-node:" + clicked)


@pytest.mark.parametrize("entry", [3.5, {"title": "t"}, {"htm": "x"}, object()])
def test_render_html_refuses_a_details_entry_it_cannot_show(graph, entry):
    from nnsight_lorsa.attribution.export import to_neuronpedia
    from nnsight_lorsa.viz import render_html

    _, _, _, g, pr = graph
    node = to_neuronpedia(g, pr, slug="x")["nodes"][0]["node_id"]
    with pytest.raises(errors.ArgumentError, match="details"):
        render_html(g, pr, details={node: entry})


def _not_a_setting(name: str) -> bool:
    from nnsight_lorsa.attribution.logit_targets import RENAMED
    from nnsight_lorsa.attribution.options import AttributionOptions

    return name not in {f.name for f in dataclasses.fields(AttributionOptions)} and name not in RENAMED


@FAST
@given(st.from_regex(r"[a-z_][a-z0-9_]{0,14}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))
       .filter(_not_a_setting))
def test_an_unknown_attribution_setting_is_an_argument_error(graph, name):
    from nnsight_lorsa.attribution import attribute
    from nnsight_lorsa.attribution.options import AttributionOptions

    model, lorsas, tcs, _, _ = graph
    with pytest.raises(errors.ArgumentError, match="unknown attribution setting") as e:
        AttributionOptions.of({name: 1})
    assert name in str(e.value) and isinstance(e.value, TypeError)
    with pytest.raises(errors.ArgumentError, match="unexpected keyword") as e:
        attribute(rm(model, lorsas, tcs), random_ids(1, 4, seed=1)[0], **{name: 1})
    assert name in str(e.value) and "attribute()" in str(e.value)


@FAST
@given(st.integers(1, 6), st.data())
def test_influence_of_a_cyclic_adjacency_is_an_argument_error(n, data):
    """A cycle among the row nodes (each row node feeds the next): the series never ends."""
    from nnsight_lorsa.attribution.scores import influence

    perm = data.draw(st.permutations(list(range(n))))
    rows = torch.zeros(n, n, dtype=torch.float64)
    rows[torch.arange(n), torch.tensor(perm)] = 1.0  # row i feeds column perm[i]: a permutation has cycles
    with pytest.raises(errors.ArgumentError, match="cycle"):
        influence(rows, torch.arange(n), torch.ones(n, dtype=torch.float64), max_iter=n + 2)


def test_block_adjacency_refuses_rows_and_tensors_that_do_not_fit(graph):
    from nnsight_lorsa.attribution import BlockAdjacency

    _, _, _, g, _ = graph
    blocks = g.block_adjacency
    assert isinstance(blocks, BlockAdjacency)
    t = blocks.to_tensors()
    short = {**t, "adjacency_blocks": t["adjacency_blocks"][:-1]}
    with pytest.raises(errors.CheckpointError, match="adjacency_blocks"):
        BlockAdjacency.from_tensors(g.nodes, short)
    with pytest.raises(errors.ShapeError, match="do not fit this adjacency"):
        blocks.write(torch.tensor([0]), torch.zeros(1, blocks.n_sources + 1))


@FAST
@given(st.text(max_size=20).filter(lambda k: not (k.startswith("L") and k.partition("->")[2].isdigit())
                                    and not (k.startswith("L") and k.split(".", 1)[0][1:].isdigit())))
def test_block_layer_refuses_a_name_that_is_no_block(key):
    from nnsight_lorsa.attribution.offload import block_layer

    with pytest.raises(errors.ArgumentError, match="names no offloaded row block"):
        block_layer(key)


def test_frozen_replacement_refuses_a_bad_offload_place_and_targets_before_its_forward(graph):
    from nnsight_lorsa.attribution.replacement import FrozenReplacement
    from nnsight_lorsa.attribution.trace import prepare

    model, lorsas, tcs, _, _ = graph
    prepared = prepare(rm(model, lorsas, tcs), random_ids(1, 5, seed=2)[0])
    M = torch.ones(1, prepared.layout.n_sources)
    with pytest.raises(errors.ArgumentError, match="offload_rows"):
        FrozenReplacement(prepared.layout, M, prepared.mhsa, offload_rows="gpu")
    with pytest.raises(errors.NotReadyError, match="unembedding"):
        FrozenReplacement(prepared.layout, M, prepared.mhsa).target_pieces()


def test_payload_report_refuses_layers_for_a_single_module(graph):
    from nnsight_lorsa.remote import payload_report

    _, lorsas, _, _, _ = graph
    with pytest.raises(errors.ArgumentError, match="layers="):
        payload_report(next(iter(lorsas.values())), layers=[1])


def test_the_base_adapter_names_what_a_new_family_lacks(graph):
    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.adapters.base import ArchitectureAdapter

    model = graph[0]
    adapter = get_adapter(model)
    with pytest.raises(errors.UnsupportedArchitectureError, match="rotary_config"):
        ArchitectureAdapter.rotary_config(adapter)
    with pytest.raises(errors.UnsupportedArchitectureError, match="mhsa_weights"):
        ArchitectureAdapter.mhsa_weights(adapter, torch.nn.Linear(1, 1), 0)


# ------------------------------------------------------------------------------------------ formats
def test_save_lorsa_refuses_another_module(tmp_path):
    from nnsight_lorsa.formats.lorsa_format import save_lorsa

    with pytest.raises(errors.ArgumentError, match="save_lorsa"):
        save_lorsa(torch.nn.Linear(2, 2), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@FAST
@given(st.from_regex(r"[a-z_][a-z0-9_]{0,14}", fullmatch=True))
def test_a_reader_option_it_does_not_take_is_an_argument_error(lorsa_dir, name):
    from nnsight_lorsa.formats import load

    if name in ("device", "dtype", "format", "d_model", "adapter", "revision", "local_files_only", "cache_dir",
                "token", "subfolder", "strict"):
        return  # options every loader takes
    with pytest.raises(errors.ArgumentError, match="takes no option") as e:
        load(lorsa_dir, **{name: 1})
    assert name in str(e.value) and isinstance(e.value, TypeError)


@pytest.fixture(scope="module")
def lorsa_dir(tmp_path_factory):
    from nnsight_lorsa.formats import save
    from nnsight_lorsa.modules.lorsa import Lorsa, LorsaConfig

    d = tmp_path_factory.mktemp("lorsa") / "l"
    save(Lorsa(LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=4, n_ov_heads=4, top_k=2)), d)
    return d


# ------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def training():
    return tiny_training_setup()


@FAST
@given(st.integers(0, 4), st.integers(1, 6), st.integers(1, 6))
def test_token_dataset_refuses_an_empty_tensor_and_a_mask_of_another_shape(n, seq, other):
    from nnsight_lorsa.training import TokenDataset

    with pytest.raises(errors.ShapeError, match="non-empty"):
        TokenDataset(torch.zeros(0, seq, dtype=torch.long))
    if n and other != seq:
        with pytest.raises(errors.ShapeError, match="target_mask"):
            TokenDataset(torch.zeros(n, seq, dtype=torch.long), torch.ones(n, other, dtype=torch.bool))


@FAST
@given(st.integers(2, 12), st.data())
def test_token_dataset_refuses_text_shorter_than_a_window(seq_len, data):
    from nnsight_lorsa.training import TokenDataset

    n = data.draw(st.integers(0, seq_len - 2))  # with BOS a window holds seq_len - 1 ids of the text
    with pytest.raises(errors.TooFewTokensError, match="fewer than one window"):
        TokenDataset.from_ids(torch.arange(2, 2 + n), seq_len, bos_token_id=0)
    text = " ".join(f"w{i}" for i in range(2, 2 + n))
    with pytest.raises(errors.TooFewTokensError, match="fewer than one window"):
        TokenDataset.from_text(tiny_tokenizer(), text, seq_len, bos_token_id=0)


def test_token_dataset_refuses_documents_without_a_token():
    from nnsight_lorsa.training import TokenDataset

    with pytest.raises(errors.TooFewTokensError, match="no document has a token"):
        TokenDataset.from_documents(tiny_tokenizer(), ["", " "], 6)


@FAST
@given(st.integers(-3, 6), st.integers(1, 4))
def test_activation_source_refuses_a_rank_outside_the_world(training, rank, world):
    from nnsight_lorsa.training import ActivationSource

    model, _, _, data = training
    source = ActivationSource.transcoder(model, 0, data, batch_size=8)
    if 0 <= rank < world:
        assert source.shard(rank, world)._shard == (rank, world)
    else:
        with pytest.raises(errors.ArgumentError, match=f"rank={rank}"):
            source.shard(rank, world)


def test_activation_source_needs_a_dataset_live_and_an_adapter_on_a_cache(training, tmp_path):
    from nnsight_lorsa.envoy.read import Site
    from nnsight_lorsa.training import ActivationSource
    from nnsight_lorsa.training.activation_cache import write_activation_cache

    model, _, adapter, data = training
    with pytest.raises(errors.ArgumentError, match="dataset"):
        ActivationSource(model, Site.mlp_input(adapter, 0), Site.mlp_output(adapter, 0))
    sites = [s for layer in range(adapter.n_layers) for s in (Site.mlp_input(adapter, layer),
                                                               Site.mlp_output(adapter, layer))]
    cache = write_activation_cache(model, sites, type(data)(data.tokens[:4]), tmp_path / "cache", batch_size=4)
    with pytest.raises(errors.ArgumentError, match="adapter="):
        ActivationSource.clt(cache, batch_size=4)


def test_trainer_refuses_a_module_it_cannot_train_and_a_fold_before_the_norms(training):
    from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
    from nnsight_lorsa.modules.lorsa import Lorsa, LorsaConfig
    from nnsight_lorsa.training import ActivationSource, LorsaObjective, TrainConfig, Trainer

    model, _, adapter, data = training
    source = ActivationSource.clt(model, data, batch_size=8)
    config = TrainConfig(total_steps=2, lr=1e-2)
    with pytest.raises(errors.ArgumentError, match="cannot train a Linear"):
        Trainer(torch.nn.Linear(2, 2), source, config)
    with pytest.raises(errors.ArgumentError, match="LorsaObjective trains a Lorsa, got a Linear"):
        LorsaObjective(torch.nn.Linear(2, 2))
    clt = CrossLayerTranscoder(CLTConfig(d_in=adapter.d_model, d_sae=32, n_layers=adapter.n_layers,
                                         activation="topk", activation_params={"k": 4}))
    with pytest.raises(errors.NotReadyError, match="estimate_norms"):
        Trainer(clt, source, config).folded()
    lorsa = Lorsa(LorsaConfig(d_model=adapter.d_model, n_qk_heads=2, d_qk_head=8, n_ov_heads=8, top_k=2))
    with pytest.raises(errors.NotReadyError, match="estimate_norms"):
        Trainer(lorsa, ActivationSource.attention(model, 1, data, 8), config).folded()


def test_data_parallel_needs_an_initialised_process_group():
    import torch.distributed as dist

    from nnsight_lorsa.training import DataParallel

    assert not (dist.is_available() and dist.is_initialized())
    with pytest.raises(errors.NotReadyError, match="init_process_group"):
        DataParallel(object())


def test_every_named_error_is_exported():
    """``from nnsight_lorsa.errors import *`` gives every error and warning the package raises
    (``UndefinedNormalizationError`` was defined after ``__all__`` and left out of it until 2026-11-29)."""
    import inspect

    from nnsight_lorsa import errors

    defined = {name for name, obj in vars(errors).items() if inspect.isclass(obj) and obj.__module__ == errors.__name__
               and issubclass(obj, (errors.LorsaError, Warning))}
    assert defined == set(errors.__all__)
