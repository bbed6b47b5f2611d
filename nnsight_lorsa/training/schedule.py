"""Warmup–stable–decay learning-rate schedule (the Lorsa authors' trainer default)."""

from __future__ import annotations


def wsd_lr_factor(step: int, total_steps: int, warmup_frac: float = 0.05, decay_frac: float = 0.2,
                  min_factor: float = 0.0) -> float:
    """Multiplier of the base LR at ``step`` (0-based: the LR of the ``step + 1``-th update): linear warmup,
    constant, then linear decay.

    ``warmup_frac`` and ``decay_frac`` are fractions of ``total_steps`` (``W = max(1, int(T·warmup_frac))``,
    ``C = int(T·decay_frac)`` steps); the warmup is ``(step + 1) / W``; the decay ends at ``min_factor`` on the last
    step; where the two overlap (``W`` forced to 1 and a decay over the whole run) the smaller holds. The Lorsa
    authors' ``constantwithwarmup`` (Llamascopium ``optim.py``: ``min(1, (s+1)/W, r + (1−r)·max(T−s, 1)/C)``) has
    the same warmup and the same straight line one step later: theirs at ``s + 1`` is ours at ``s``, so
    their last step is at ``r + (1−r)/C``, ours at ``r`` (tested: ``tests/training/test_wsd_against_authors.py``).

    Source: Lorsa paper (He et al. 2025) §3.2 (warmup–stable–decay); Llamascopium ``optim.py``.
    """
    warmup = max(1, int(total_steps * warmup_frac))
    decay = int(total_steps * decay_frac)
    factor = (step + 1) / warmup if step < warmup else 1.0
    decay_start = total_steps - decay
    if decay <= 0 or step < decay_start:
        return factor
    progress = (step - decay_start + 1) / decay
    # the smaller of the two where they meet (a decay over the whole run and the one-step warmup a warmup_frac of
    # under one step gets: the authors' min; until 2026-11-29 the warmup's 1.0 won at step 0)
    return min(factor, max(min_factor, 1.0 - (1.0 - min_factor) * progress))
