"""Causal interventions on MHSA heads, Lorsa heads and SAE/transcoder features (seed 004 §10)."""

from ..envoy.replacement_model import ReplacementModel
from ..envoy.targets import Bound, Feature, LorsaHead, MHSAHead, Target, TargetIndexError
from .interventions import ablate, mean_activations, patch, read, scale, steer
from .metrics import logit_difference, relative_effect
from .path_patching import HeadInput, PathPatchingResult, path_patching

__all__ = [
    "Bound", "Feature", "HeadInput", "LorsaHead", "MHSAHead", "ReplacementModel", "Target", "TargetIndexError",
    "ablate",    "logit_difference", "mean_activations", "patch", "PathPatchingResult", "path_patching", "read",
    "relative_effect", "scale", "steer",
]
