"""Causal interventions on MHSA heads, Lorsa heads and SAE/transcoder features (docs/patching.md).

A :class:`ReplacementModel` validates a target (:class:`MHSAHead`, :class:`LorsaHead`, :class:`Feature`)
before anything runs and binds it (``rm(target)``) for the interventions inside a trace —
:func:`read`, :func:`ablate`, :func:`scale`, :func:`steer`, :func:`patch` (after ``rm.prepare(targets)`` or
:func:`padding_mask` first in the body, they refuse positions that are padding in a row of a padded batch);
:func:`freeze_attention` records the patterns that ``rm.prepare(targets, frozen=...)`` holds every attention at
(circuit-tracer's ``freeze_attention=True``). The experiments run their
own traces: :func:`activation_patching`, :func:`path_patching` (Wang et al.'s sender → receiver paths),
:func:`ablation_effect`, :func:`random_ablation_control`, :func:`head_swap`, :func:`circuit_size`;
task prompts from :func:`induction_task`, :func:`ioi_task`, :func:`greater_than_task`,
:func:`arithmetic_task`; metrics :func:`logit_difference`, :func:`relative_effect`.
"""

from ..envoy.padding import padding_mask
from ..envoy.replacement_model import ReplacementModel
from ..envoy.targets import Bound, Feature, LorsaHead, MHSAHead, Target, TargetIndexError
from .circuit import CircuitSize, circuit_size
from .experiments import ablation_effect, activation_patching, head_swap, random_ablation_control
from .frozen import FrozenAttention, freeze_attention
from .interventions import ablate, mean_activations, patch, read, scale, steer
from .metrics import logit_difference, relative_effect
from .path_patching import HeadInput, PathPatchingResult, path_patching
from .tasks import TaskBatch, arithmetic_task, greater_than_task, induction_task, ioi_task

__all__ = [
    "Bound", "CircuitSize", "Feature", "FrozenAttention", "HeadInput", "LorsaHead", "MHSAHead",
    "PathPatchingResult", "ReplacementModel", "Target", "TargetIndexError", "TaskBatch", "ablate",
    "ablation_effect", "activation_patching", "arithmetic_task", "circuit_size", "freeze_attention",
    "greater_than_task", "head_swap", "induction_task", "ioi_task", "logit_difference", "mean_activations",
    "padding_mask", "patch", "path_patching", "random_ablation_control", "read", "relative_effect", "scale",
    "steer",
]
