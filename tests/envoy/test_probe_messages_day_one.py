"""Messages a second researcher's probe (2026-11-30) found wrong: ``TranscoderSet.from_pretrained`` of a Lorsa
folder said "use SAESet"; a layer key ``"1"`` was "out of range" (it is a str); ``head_dashboard_data`` /
``qk_feature_impacts`` refused a numpy head as "out of range"."""

from __future__ import annotations

import numpy as np
import pytest

from nnsight_lorsa import LorsaSet, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.assets import default_lorsa_dir, default_transcoder_dir
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.targets import TargetIndexError, check_index
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError


def test_a_refusal_of_another_kind_names_the_set_that_holds_it():
    model = load_model()
    for cls, src, want in ((TranscoderSet, default_lorsa_dir(), "use LorsaSet"),
                           (SAESet, default_lorsa_dir(), "use LorsaSet"),
                           (LorsaSet, default_transcoder_dir(), "use TranscoderSet")):
        with pytest.raises(ConfigMismatchError, match=want):
            cls.from_pretrained(model, src)


def test_a_str_layer_is_no_int_and_a_numpy_head_is_its_int():
    model = load_model()
    adapter = get_adapter(model)
    with pytest.raises(LayerOutOfRangeError, match="must be an int"):
        adapter.check_layer("1")
    with pytest.raises(LayerOutOfRangeError, match="out of range"):
        adapter.check_layer(99)
    check_index(np.int64(7), 16, "head")  # an int
    with pytest.raises(TargetIndexError, match="must be an int"):
        check_index(7.0, 16, "head")
    with pytest.raises(TargetIndexError, match="out of range"):
        check_index(np.int64(16), 16, "head")
