"""Checkpoint formats: our own (:mod:`.lorsa_format`) and the Lorsa authors' (:mod:`.llamascopium`)."""

from __future__ import annotations

from .llamascopium import load_llamascopium_lorsa
from .lorsa_format import load_lorsa, save_lorsa

__all__ = ["load_llamascopium_lorsa", "load_lorsa", "save_lorsa"]
