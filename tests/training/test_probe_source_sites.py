"""An ``ActivationSource`` given a module path string where a ``Site`` goes is refused, naming the argument.

``ActivationSource.sae(model, "model.layers.1", data)`` took the string as a sequence of 14 one-character "sites"
(a stacked, CLT-like source); the trainer then refused it with "a SparseAutoencoder reads one site: the source
stacks 14 (a CLT's source)", which names neither the argument nor the fix.
"""

from __future__ import annotations

import pytest
from helpers import tiny_training_setup
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.training import ActivationSource

SETUP = tiny_training_setup()


@settings(max_examples=20, deadline=None)
@given(bad=st.one_of(st.text(min_size=0, max_size=20), st.integers(), st.none(), st.just([]),
                     st.lists(st.text(max_size=5), min_size=1, max_size=3)), where=st.sampled_from(["x", "y"]))
def test_a_site_that_is_not_a_site_is_refused_naming_the_argument(bad, where):
    model, _, adapter, data = SETUP
    good = Site.mlp_input(adapter, 1)
    if where == "x" and bad is None:
        bad = ""  # x=None is no site either; y=None means "the same as x"
    kwargs = {"x": bad, "y": None} if where == "x" else {"x": good, "y": bad}
    if where == "y" and bad is None:
        ActivationSource(model, dataset=data, batch_size=8, **kwargs)  # y defaults to x: fine
        return
    with pytest.raises(ArgumentError, match=rf"ActivationSource\({where}="):
        ActivationSource(model, dataset=data, batch_size=8, **kwargs)


def test_the_sae_constructor_refuses_a_module_path_string():
    model, _, adapter, data = SETUP
    with pytest.raises(ArgumentError, match=r"ActivationSource\(x=.*Site.*'model.layers.1'"):
        ActivationSource.sae(model, adapter.layer_path(1), data, batch_size=8)
    ActivationSource.sae(model, Site.resid_post(adapter, 1), data, batch_size=8)  # the Site itself: fine
