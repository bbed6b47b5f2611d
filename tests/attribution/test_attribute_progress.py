"""``attribute``'s progress bar (issue 25): on by default when stderr is a terminal (it was always off unless
asked), off otherwise, ``progress=True`` / ``False`` explicit."""

from __future__ import annotations

import sys

import pytest
from helpers import attribution_setup, random_ids, recording_tqdm, rm

from nnsight_lorsa.attribution import attribute


@pytest.fixture(scope="module")
def replacement():
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs), random_ids(1, 6, seed=3)[0]


@pytest.mark.parametrize(("tty", "progress", "shown"), [
    (True, None, True), (False, None, False), (False, True, True), (True, False, False)])
def test_attribute_shows_a_bar_on_a_terminal_by_default(replacement, monkeypatch, tty, progress, shown):
    import importlib

    module = importlib.import_module("nnsight_lorsa.attribution.engine")
    disabled = recording_tqdm(monkeypatch, module)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    rm_, ids = replacement
    kwargs = {} if progress is None else {"progress": progress}
    g = attribute(rm_, ids, batch_size=32, **kwargs)
    assert len(g.logit_ids) > 0
    assert disabled == [not shown]
