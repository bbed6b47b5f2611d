"""Mutation probe, round 10 (docs/reliability.md): the client's side of a remote intervened pass
(``attribution/remote_handles.py``: reading a remote block's ``attribute(...)`` calls, decoding a server's record)
and the options object (``attribution/options.py``), each test seen failing with the mutant it names and passing
without. Nothing is sent: the block is read with ``ast``, the records are built with the server's own
:func:`~nnsight_lorsa.attribution.intervened_record.to_record`."""

from __future__ import annotations

import ast
import inspect
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import attribution_setup, rm

from nnsight_lorsa.attribution import attribute, checks, remote_handles
from nnsight_lorsa.attribution.intervened import IntervenedAttribution
from nnsight_lorsa.attribution.intervened_record import KEY_ATTR, RECORD_VERSION, encode, to_record
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.envoy.edit_log import Edit
from nnsight_lorsa.envoy.targets import Feature, LorsaHead
from nnsight_lorsa.errors import ArgumentError, ConfigMismatchError, PlacementError, TraceOrderError
from nnsight_lorsa.ndif_rules import NotWhitelistedError


@pytest.fixture(scope="module")
def bundle():
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs)


def _check(source: str, **names) -> None:
    """``check_block_calls`` of the block ``source``, ``attribute`` and ``names`` known from its scope (``rm`` and
    ``t`` unknown: the replacement's and the tracer's checks are not what these tests read)."""
    remote_handles.check_block_calls(ast.parse(source).body, {"attribute": attribute, **names})


def test_a_negative_literal_option_of_a_remote_block_is_refused_before_sending():
    """(Mutant: ``-x`` read as ``x``.) ``batch_size=-5`` is the local call's ConfigMismatchError (``>= 1``), raised
    before the request goes; ``+5`` passes."""
    with pytest.raises(ConfigMismatchError, match=">= 1, got -5") as info:
        _check("attribute(rm, tracer=t, batch_size=-5)")
    assert "nothing was sent" in str(info.value)
    _check("attribute(rm, tracer=t, batch_size=+5)")
    with pytest.raises(ConfigMismatchError, match="got -1"):
        AttributionOptions(zero_positions=-1)  # the local rule the block's check applies


def test_an_explicit_tracer_none_in_a_remote_block_is_the_prompts_graph_and_refused():
    """(Mutant: ``"tracer" not in arguments`` for ``arguments.get("tracer") is None``.) ``tracer=None`` is the
    prompt's graph, as ``attribute(rm, prompt)`` (``attribute``'s default): the engine does not travel, a
    NotWhitelistedError, not the traced call's "not both"."""
    for source in ("attribute(rm, p)", "attribute(rm, p, tracer=None)"):
        with pytest.raises(NotWhitelistedError, match="remote=True"):
            _check(source)


def test_a_call_that_python_would_refuse_names_the_block_call():
    """(Mutant: only LorsaError annotated with the call.) Too many positional arguments: Python's TypeError, with
    the call and "nothing was sent" appended."""
    with pytest.raises(TypeError, match="nothing was sent") as info:
        _check("attribute(rm, p, t, 1, 2, 3, 4, 5)")
    with pytest.raises(TypeError) as local:
        attribute(None, None, None, 1, 2, 3, 4, 5)
    assert str(local.value).split(" (")[0] in str(info.value)


def test_a_record_of_another_version_is_refused():
    """(Mutant: the version check dropped.) ``from_record``'s docstring: one of another version is a
    ConfigMismatchError, before the replacement is touched."""
    record = to_record(1, {}, [], encode(AttributionOptions()), None)
    with pytest.raises(ConfigMismatchError, match=f"version {RECORD_VERSION}"):
        remote_handles.from_record({**record, "version": RECORD_VERSION + 1}, None)


def test_a_dataclass_of_a_module_only_named_like_the_package_is_refused():
    """(Mutant: the package test by prefix, ``startswith``.) ``decode``'s docstring: a dataclass of a module outside
    this package is refused; ``nnsight_lorsa_extra`` is another package."""
    with pytest.raises(ConfigMismatchError, match="not a class of this package"):
        remote_handles.decode({"__dataclass__": ["nnsight_lorsa_extra.mod", "C"], "fields": {}})
    assert remote_handles.decode(encode(Feature(2, 7, "transcoder"))) == Feature(2, 7, "transcoder")


def test_a_record_comes_back_with_its_edits_positions_and_the_servers_error_class(bundle):
    """(Mutants: the edits' positions dropped; the error class searched among TraceOrderError's subclasses only.)
    The record the server builds (``to_record``) turns back into a handle with the same edits, and the problem as
    the same class of this package with the same message."""
    edits = [Edit(LorsaHead(1, 3), [2, 4]), Edit(Feature(0, 5, "transcoder"), None)]
    for problem in (ConfigMismatchError("bad edit"), PlacementError("off the device"),
                    TraceOrderError("too late")):
        record = to_record(id(bundle), {"x": 1}, edits, AttributionOptions(batch_size=8), problem)
        handle = remote_handles.from_record(record, bundle)
        assert isinstance(handle, IntervenedAttribution) and handle.edits == edits
        assert type(handle._problem) is type(problem) and str(handle._problem) == str(problem)
        assert handle._options == AttributionOptions(batch_size=8)


def test_bundles_in_a_list_are_marked_and_unmarked_records_stay_records(bundle):
    """(Mutants: only dicts searched one level in; every record rebuilt, marked or not.) ``mark_bundles``'s
    docstring: bundles among the names and one level into their dicts, lists and tuples; ``rebuild_results``': a
    record whose bundle this request did not mark stays a record."""
    for names in ({"rms": [bundle]}, {"rms": (bundle,)}, {"rms": {"a": bundle}}, {"rm": bundle}):
        assert remote_handles.mark_bundles(names) == {id(bundle): bundle}
        assert getattr(bundle, KEY_ATTR) == id(bundle)
    foreign = to_record(id(bundle) + 1, {}, [], encode(AttributionOptions()), None)
    ours = to_record(id(bundle), {}, [], encode(AttributionOptions()), None)
    out = remote_handles.rebuild_results({"a": foreign, "b": ours, "c": 3}, {id(bundle): bundle})
    assert out["a"] is foreign and out["c"] == 3 and isinstance(out["b"], IntervenedAttribution)


def test_remote_is_a_bool_or_local_and_never_an_int():
    """(Mutant: ``remote in (True, False, "local")``, which lets ``1`` and ``0`` through as ``True == 1``.) The
    class docstring: ``remote`` other than a bool or ``"local"`` is an ArgumentError."""
    for ok in (True, False, "local"):
        assert AttributionOptions(remote=ok).remote == ok
    for bad in (1, 0, 1.0):
        with pytest.raises(ArgumentError, match="remote"):
            AttributionOptions(remote=bad)


def test_an_unknown_setting_of_a_named_call_is_refused_as_python_refuses_an_unknown_keyword():
    """(Mutant: ``and`` for ``or`` in ``of``.) With ``where``, an unknown name is refused as that call would refuse
    it (``refuse_renamed``: "got unexpected keyword argument(s)"), an old name with its new spelling."""
    with pytest.raises(TypeError, match=r"attribute\(\) got unexpected keyword argument\(s\) \['bogus'\]"):
        AttributionOptions.of({"bogus": 1}, "attribute")
    with pytest.raises(ArgumentError, match="logit_tokens=.*is gone"):
        AttributionOptions.of({"logit_tokens": [1]}, "attribute")
    with pytest.raises(TypeError, match="unknown attribution setting"):
        AttributionOptions.of({"bogus": 1})


@pytest.mark.parametrize("name", ["qk_heads", "zero_positions"])
def test_qk_heads_and_zero_positions_of_the_wrong_type_are_argument_errors(name):
    """(Mutant: every wrongly typed ``zero_positions`` / ``qk_heads`` a ConfigMismatchError.) The class docstring:
    ``qk_heads`` / ``zero_positions`` of the wrong type is an ArgumentError (a TypeError); a negative one a
    ConfigMismatchError. (``zero_positions`` of the wrong type was a ConfigMismatchError until 2026-11-29, against
    the docstring; :func:`.layout.build_layout` now says the same.)"""
    for bad in ("2", 2.0, True):  # the checks themselves: the tests' type-check hook refuses these at __init__
        options = AttributionOptions()
        object.__setattr__(options, name, bad)
        with pytest.raises(ArgumentError, match=name):
            options.__post_init__()
    with pytest.raises(ConfigMismatchError, match=name):
        AttributionOptions(**{name: -1})


# ------------------------------------------------------------------ attribution/checks.py
def _rank_formula(a: list[float], b: list[float]) -> float:
    """Spearman's rho of distinct values by its textbook formula, ``1 − 6 Σ d² / (n (n² − 1))``, ``d`` the rank
    differences, ranks counted by hand (no torch, no scipy: the reference stays independent and always runs)."""
    n = len(a)
    rank_a = {v: i for i, v in enumerate(sorted(a))}
    rank_b = {v: i for i, v in enumerate(sorted(b))}
    d2 = sum((rank_a[x] - rank_b[y]) ** 2 for x, y in zip(a, b, strict=True))
    return 1 - 6 * d2 / (n * (n * n - 1))


def test_spearman_is_the_rank_correlation_on_unsorted_values():
    """(Mutant: the values' sort order taken for their ranks, one ``argsort`` short.) Spearman's rho of distinct
    values against its textbook formula (the same as ``scipy.stats.spearmanr`` for distinct values, which the CI does
    not install); a monotone transform of one side leaves it 1."""
    g = torch.Generator().manual_seed(0)
    for n in (3, 7, 20):
        a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        assert checks.spearman(a, b) == pytest.approx(_rank_formula(a.tolist(), b.tolist()), abs=1e-9)
        assert checks.spearman(a, a.exp() * 3 + 1) == pytest.approx(1.0)
    assert math.isnan(checks.spearman(torch.tensor([1.0]), torch.tensor([2.0])))


def test_circuit_metrics_combine_the_ablations_as_documented(monkeypatch):
    """(Mutants: completeness ``whole / base``; minimality on signed effects; faithfulness against signed effects;
    Lorsa and transcoder targets swapped.) The module docstring's formulas, from Δℓ values given here (``_delta``
    replaced: the model's part is ``test_attribution.py::test_circuit_metrics_match_single_ablations``):
    completeness ``1 − Δℓ(all ablated) / Δℓ(baseline)``, minimality the fraction of ``|effect| ≥ min_effect ·
    |Δℓ(baseline)|``, faithfulness Spearman's rho of influence and ``|effect|``."""
    from nnsight_lorsa.attribution.graph import EMBEDDING, LOGIT, LORSA, TRANSCODER

    kind = torch.tensor([EMBEDDING, LORSA, TRANSCODER, LORSA, TRANSCODER, LOGIT])
    nodes = SimpleNamespace(kind=kind, layer=torch.tensor([0, 1, 0, 2, 2, 0]), index=torch.tensor([0, 4, 9, 1, 3, 7]),
                            pos=torch.tensor([0, 2, 1, 3, 0, 3]))
    graph = SimpleNamespace(nodes=nodes, logit_ids=torch.tensor([5]), logit_probs=torch.tensor([1.0]),
                            tokens=torch.zeros(4, dtype=torch.long))
    pruned = SimpleNamespace(node_mask=torch.tensor([True, True, True, True, True, True]),
                             node_influence=torch.tensor([0.0, 0.4, 0.1, 0.3, 0.2, 0.0]))
    base, whole = -2.0, -0.5
    effects = {LorsaHead(1, 4): -1.5, Feature(0, 9, "transcoder"): 0.01, LorsaHead(2, 1): 1.0,
               Feature(2, 3, "transcoder"): -0.3}
    positions = {LorsaHead(1, 4): 2, Feature(0, 9, "transcoder"): 1, LorsaHead(2, 1): 3,
                 Feature(2, 3, "transcoder"): 0}

    def delta(replacement, ids, ablations, token, incorrect):
        assert token == 7 and incorrect is None
        out = []
        for group in ablations:
            assert all(positions[t] == p for t, p in group), group
            out.append(base if not group else whole if len(group) == len(effects) else base - effects[group[0][0]])
        return torch.tensor(out)

    monkeypatch.setattr(checks, "_delta", delta)
    monkeypatch.setattr(checks, "ReplacementModel", lambda *a, **k: None)
    # the argument checks (tests/attribution/test_graph_argument_ranges.py) would refuse the stand-ins
    monkeypatch.setattr(checks, "check_replacement_model", lambda value, where: value)
    monkeypatch.setattr(checks, "check_pruned_graph", lambda graph, pruned, where: None)
    monkeypatch.setattr(checks, "vocabulary_size", lambda model: None)
    monkeypatch.setattr(checks, "_targets", inspect.unwrap(checks._targets))  # stand-ins: past the type-check hook
    fake = SimpleNamespace(model=None, lorsas=None, transcoders=None, adapter=None)
    metrics = inspect.unwrap(checks.circuit_metrics)
    cm = metrics(fake, graph, pruned, min_effect=0.1)
    assert cm.nodes.tolist() == [1, 2, 3, 4]
    assert cm.completeness == pytest.approx(1 - whole / base)
    assert cm.effects.tolist() == pytest.approx([-1.5, 0.01, 1.0, -0.3])
    assert cm.minimal_fraction == pytest.approx(3 / 4)  # |effect| >= 0.1 * |-2|: all but 0.01
    influence, size = [0.4, 0.1, 0.3, 0.2], [1.5, 0.01, 1.0, 0.3]
    assert cm.faithfulness == pytest.approx(1.0)  # the same order: rho of influence and |effect| is 1
    assert sorted(range(4), key=influence.__getitem__) == sorted(range(4), key=size.__getitem__)


def test_a_traced_call_in_a_remote_block_accepts_a_model_with_stored_edits(bundle, monkeypatch):
    """(Mutant: the block's replacement checked as a prompt's, ``in_trace=False``.) ``check_replacement``'s
    docstring: edits stored by ``model.edit()`` refuse a prompt's graph, but ``tracer=`` inside a trace of the model
    attributes the edited pass; the block's call is the traced one, so it is not refused before sending."""
    from nnsight_lorsa.attribution.engine import check_replacement
    from nnsight_lorsa.envoy import nnsight_internals

    monkeypatch.setattr(nnsight_internals, "stored_edits", lambda model: 1)  # as after one model.edit() block
    with pytest.raises(ArgumentError, match="model.edit"):
        check_replacement(bundle)
    _check("attribute(rm, tracer=t, batch_size=8)", rm=bundle)
