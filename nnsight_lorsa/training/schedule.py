"""Warmup–stable–decay learning-rate schedule (the Lorsa authors' trainer default)."""

from __future__ import annotations


def wsd_lr_factor(step: int, total_steps: int, warmup_frac: float = 0.05, decay_frac: float = 0.2,
                  min_factor: float = 0.0) -> float:
    """Multiplier of the base LR at ``step``: linear warmup, constant, then linear decay.

    ``warmup_frac`` and ``decay_frac`` are fractions of ``total_steps``; the decay ends at
    ``min_factor`` on the last step.
    """
    warmup = max(1, int(total_steps * warmup_frac))
    decay = int(total_steps * decay_frac)
    if step < warmup:
        return (step + 1) / warmup
    decay_start = total_steps - decay
    if decay <= 0 or step < decay_start:
        return 1.0
    progress = (step - decay_start + 1) / decay
    return max(min_factor, 1.0 - (1.0 - min_factor) * progress)
