"""Test configuration: runtime shape/type checking of the package (jaxtyping + beartype).

The import hook must be installed before anything imports ``nnsight_lorsa``; the package itself
never imports beartype (code that may run on an NDIF server must not need it).
"""

from __future__ import annotations

import os
import sys

import torch
from jaxtyping import install_import_hook

sys.path.insert(0, os.path.dirname(__file__))
install_import_hook("nnsight_lorsa", "beartype.beartype")
torch.set_num_threads(min(2, torch.get_num_threads()))

# Property-based tests: random examples on a developer's machine (they explore), the same examples on CI
# (``CI`` set: derandomized, so a landing never hinges on which inputs a run happened to draw).
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Import (and so type-check-decorate) the package before anything imports nnsight: decorating a
# module's functions after nnsight has patched torch trips beartype ("unhashable instancemethod").
import nnsight_lorsa  # noqa: E402,F401
import nnsight_lorsa.envoy.lorsa_set  # noqa: E402,F401
import nnsight_lorsa.training.evaluate  # noqa: E402,F401
import nnsight_lorsa.training.trainer  # noqa: E402,F401
