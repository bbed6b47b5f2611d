"""Checkpoint formats: one front door.

:func:`load` reads a checkpoint directory or Hugging Face repo id of any registered format, detecting
the format from its files unless ``format=`` names it; :func:`save` writes a module in a format
(``"nnsight_lorsa"`` by default); :func:`load_all` loads every checkpoint of a folder.

Formats (:data:`FORMATS`, :mod:`.registry`): ``"nnsight_lorsa"`` (ours, for Lorsas and sparse
coders: :mod:`.lorsa_format`, :mod:`.sparse_coder_format`), ``"llamascopium"`` (the Lorsa authors'
library, Lorsas and SAEs: :mod:`.llamascopium`, :mod:`.llamascopium_sae`), ``"saelens"``
(:mod:`.saelens`; SAELens release names: :mod:`.saelens_releases`), ``"sparsify"`` (:mod:`.sparsify`)
and ``"circuit_tracer"`` (transcoder sets and
CLTs: :mod:`.circuit_tracer`). One reader without detection is ``load(path, format=name)``; the
per-format functions (``lorsa_format.load_lorsa``, ``saelens.save_saelens``, …) stay in their
modules, outside this package's names. Each format module is a small reader in three steps
(:class:`~.reader.Reader`: ``parse_config`` -> ``load_weights`` -> ``build``) that declares its
config fields (:class:`~.validate.Field`) and tensors (:class:`~.validate.TensorSpec`); one
validation layer (:mod:`.validate`) checks them and is the only module that raises a file error:
:class:`~nnsight_lorsa.errors.CheckpointError` naming the file and the key. :mod:`.hook_sites` maps
other libraries' hook names onto our module paths.

Example::

    from nnsight_lorsa.formats import load, save
    save(sae, "ckpt/sae", format="saelens", hook_name="blocks.3.hook_resid_post")
    again = load("ckpt/sae")                      # detected: saelens
"""

from __future__ import annotations

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
from .saelens_releases import SAELensRelease, resolve_release

__all__ = [
    "DEFAULT_FORMAT", "FORMATS", "Format", "LoadedModules", "PartialLoadWarning", "SAELensRelease", "detect_format",
    "load", "load_all", "register_format", "resolve_release", "save",
]
