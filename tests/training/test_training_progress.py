"""Progress bars of evaluation and activation caching (issue 25): on by default when stderr is a terminal,
off otherwise, ``progress=True`` / ``False`` explicit."""

from __future__ import annotations

import importlib
import sys

import pytest
from helpers import LAYER, make_lorsa, recording_tqdm, tiny_training_setup

from nnsight_lorsa import LorsaSet
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.training import TokenDataset, evaluate
from nnsight_lorsa.training import activation_cache as cache_module

evaluate_module = importlib.import_module("nnsight_lorsa.training.evaluate")  # the name is the function


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


@pytest.mark.parametrize(("tty", "progress", "shown"), [
    (True, None, True), (False, None, False), (False, True, True), (True, False, False)])
def test_evaluate_shows_a_bar_on_a_terminal_by_default(setup, monkeypatch, tty, progress, shown):
    model, hf, adapter, data = setup
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    disabled = recording_tqdm(monkeypatch, evaluate_module)
    kwargs = {} if progress is None else {"progress": progress}
    ev = evaluate(lorsas, TokenDataset(data.tokens[:4]), at=LAYER, batch_size=2, **kwargs)
    assert ev.n_tokens > 0
    assert disabled == [not shown]


@pytest.mark.parametrize(("tty", "progress", "shown"), [
    (True, None, True), (False, None, False), (False, True, True), (True, False, False)])
def test_activation_caching_shows_a_bar_on_a_terminal_by_default(setup, tmp_path, monkeypatch, tty, progress,
                                                                   shown):
    model, _, adapter, data = setup
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    disabled = recording_tqdm(monkeypatch, cache_module)
    kwargs = {} if progress is None else {"progress": progress}
    cache = cache_module.write_activation_cache(model, [Site.resid_post(adapter, 1)], TokenDataset(data.tokens[:6]),
                                                tmp_path / "cache", batch_size=4, **kwargs)
    assert cache is not None
    assert disabled == [not shown]
