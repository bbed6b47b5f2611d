"""The progress-bar default shared by the long-running calls (attribution, evaluation, activation caching)."""

from __future__ import annotations

import sys


def show_progress(progress: bool | None) -> bool:
    """``progress`` when given (True / False); None (the default of ``attribute``, ``evaluate``,
    ``write_activation_cache``): on when stderr is a terminal (``sys.stderr.isatty()``), off in logs,
    pipes and notebooks' captured streams."""
    if progress is not None:
        return bool(progress)
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False
