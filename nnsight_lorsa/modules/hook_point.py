"""Identity modules that give an intermediate value an address.

nnsight makes only ``nn.Module`` children addressable (``envoy.<child>.output``); routing a
value through a :class:`HookPoint` makes it readable and editable inside a trace at no cost
(the TransformerLens hook-point idea; nnsight's own ``WrapperModule`` plays the same role, but
this one needs only torch so the modules stay importable without nnsight).
"""

from __future__ import annotations

import torch
from torch import nn


class HookPoint(nn.Module):
    """``forward(x) = x``: an addressable location for a value computed inside a module.

    Source: TransformerLens hook points (``transformer_lens/hook_points.py``).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` unchanged (any shape, dtype and device): the value nnsight reads or edits here.

        Source: TransformerLens hook points (``transformer_lens/hook_points.py``).
        """
        return x
