"""Head analysis of Lorsas against the model's MHSA (Lorsa paper §5 and App. E–F; docs/analysis.md).

* :func:`mhsa_correlation` — oblique projection of each Lorsa head onto the MHSA heads (App. E.1–E.2);
* :func:`ov_logit_lens` / :func:`ov_feature_cosines` — what a head's OV circuit writes (logits, SAE features; App. F.2);
* :func:`collect_top_activations` — top-activating contexts and z-patterns of heads (:class:`TopActivations`);
* :func:`qk_feature_impacts` — SAE features' effect on a head's QK circuit by ablation (App. F.1).
"""

from .heads import MHSACorrelation, collect_top_activations, mhsa_correlation, ov_feature_cosines, ov_logit_lens
from .qk_ablation import QKFeatureImpacts, qk_feature_impacts
from .top_activations import TopActivations

__all__ = ["MHSACorrelation", "QKFeatureImpacts", "TopActivations", "collect_top_activations", "mhsa_correlation",
           "ov_feature_cosines", "ov_logit_lens", "qk_feature_impacts"]
