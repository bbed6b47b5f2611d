"""Checkpoint formats: our own (:mod:`.lorsa_format`, :mod:`.sparse_coder_format`), the Lorsa authors'
(:mod:`.llamascopium`), SAELens (:mod:`.saelens`), sparsify (:mod:`.sparsify`) and circuit-tracer
(:mod:`.circuit_tracer`)."""

from __future__ import annotations

from .circuit_tracer import (
    load_circuit_tracer,
    load_circuit_tracer_clt,
    load_circuit_tracer_transcoders,
    save_circuit_tracer_clt,
    save_circuit_tracer_transcoders,
)
from .llamascopium import load_llamascopium_lorsa
from .llamascopium_sae import load_llamascopium_sae
from .lorsa_format import load_lorsa, save_lorsa
from .saelens import load_saelens, save_saelens
from .sparse_coder_format import load_sparse_coder, save_sparse_coder
from .sparsify import load_sparsify, load_sparsify_many, save_sparsify

__all__ = [
    "load_circuit_tracer", "load_circuit_tracer_clt", "load_circuit_tracer_transcoders", "load_llamascopium_lorsa",
    "load_llamascopium_sae",
    "load_lorsa", "load_saelens", "load_sparse_coder", "load_sparsify", "load_sparsify_many",
    "save_circuit_tracer_clt", "save_circuit_tracer_transcoders", "save_lorsa", "save_saelens",
    "save_sparse_coder", "save_sparsify",
]
