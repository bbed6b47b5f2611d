"""Checkpoint formats: one front door.

:func:`load` reads a checkpoint directory or Hugging Face repo id of any registered format, detecting
the format from its files unless ``format=`` names it; :func:`save` writes a module in a format
(``"nnsight_lorsa"`` by default); :func:`load_all` loads every checkpoint of a folder.

Formats (:data:`FORMATS`, :mod:`.registry`): ``"nnsight_lorsa"`` (ours, for Lorsas and sparse
coders: :mod:`.lorsa_format`, :mod:`.sparse_coder_format`), ``"llamascopium"`` (the Lorsa authors'
library, Lorsas and SAEs: :mod:`.llamascopium`, :mod:`.llamascopium_sae`), ``"saelens"``
(:mod:`.saelens`; SAELens release names: :mod:`.saelens_releases`), ``"sparsify"`` (:mod:`.sparsify`)
and ``"circuit_tracer"`` (transcoder sets and
CLTs: :mod:`.circuit_tracer`). Each format module is a small reader in three steps
(:class:`~.reader.Reader`: ``parse_config`` -> ``load_weights`` -> ``build``); every reader goes
through one validation layer (:mod:`.validate`) whose errors are
:class:`~nnsight_lorsa.errors.CheckpointError` naming the file and the key. :mod:`.hook_sites` maps
other libraries' hook names onto our module paths.

Example::

    from nnsight_lorsa.formats import load, save
    save(sae, "ckpt/sae", format="saelens", hook_name="blocks.3.hook_resid_post")
    again = load("ckpt/sae")                      # detected: saelens
"""

from __future__ import annotations

from .circuit_tracer import (
    load_circuit_tracer_clt,
    load_circuit_tracer_transcoders,
    save_circuit_tracer_clt,
    save_circuit_tracer_transcoders,
)
from .llamascopium import load_llamascopium_lorsa
from .llamascopium_sae import load_llamascopium_sae
from .lorsa_format import load_lorsa, save_lorsa
from .registry import (
    DEFAULT_FORMAT,
    FORMATS,
    Format,
    LoadedModules,
    PartialLoadWarning,
    detect_format,
    load,
    load_all,
    register_format,
    save,
)
from .saelens import load_saelens, save_saelens
from .saelens_releases import SAELensRelease, resolve_release
from .sparse_coder_format import load_sparse_coder, save_sparse_coder
from .sparsify import load_sparsify, save_sparsify

__all__ = [
    "DEFAULT_FORMAT", "FORMATS", "Format", "LoadedModules", "PartialLoadWarning", "detect_format", "load", "load_all",
    "register_format", "save",
    "load_circuit_tracer_clt", "load_circuit_tracer_transcoders", "load_llamascopium_lorsa", "load_llamascopium_sae",
    "SAELensRelease", "resolve_release",
    "load_lorsa", "load_saelens", "load_sparse_coder", "load_sparsify",
    "save_circuit_tracer_clt", "save_circuit_tracer_transcoders", "save_lorsa", "save_saelens", "save_sparse_coder",
    "save_sparsify",
]
