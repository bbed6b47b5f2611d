"""analysis."""

from .qk_ablation import QKFeatureImpacts, qk_feature_impacts

__all__ = ["QKFeatureImpacts", "qk_feature_impacts"]
