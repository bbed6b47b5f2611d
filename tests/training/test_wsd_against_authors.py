"""``wsd_lr_factor`` against the Lorsa authors' ``constantwithwarmup`` schedule (Llamascopium ``optim.py``, copied
below as a formula): the same warmup ``(s + 1) / W``, the same plateau, and the same decay line one step earlier (ours
at step ``s`` is theirs at ``s + 1``: ours reaches ``r`` on the last step, theirs ``r + (1 − r) / C``)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.training.schedule import wsd_lr_factor


def _theirs(s: int, total: int, warm: int, cool: int, r: float) -> float:
    """Llamascopium 2.0.0b34 ``get_scheduler("constantwithwarmup")``'s lambda."""
    return min(1.0, (s + 1) / warm, r + (1 - r) / cool * max(total - s, 1))


@pytest.mark.parametrize(("total", "warmup_frac", "decay_frac", "r"),
                         [(100, 0.05, 0.2, 0.0), (100, 0.05, 0.2, 1 / 32), (1000, 0.1, 0.3, 0.5), (37, 0.2, 0.5, 0.0),
                          (10, 0.0, 0.2, 0.0), (12, 0.25, 0.75, 1 / 32)])
def test_our_schedule_is_the_authors_with_the_decay_one_step_earlier(total, warmup_frac, decay_frac, r) -> None:
    warm, cool = max(1, int(total * warmup_frac)), int(total * decay_frac)
    ours = [wsd_lr_factor(s, total, warmup_frac, decay_frac, r) for s in range(total)]
    for s in range(total):
        if s < warm:
            assert ours[s] == pytest.approx(_theirs(s, total, warm, cool, r), rel=1e-12), s
        elif s < total - cool:
            assert ours[s] == 1.0 == _theirs(s, total, warm, cool, r), s
        elif s < total - 1:  # (theirs clamps T − s at 1, so their step T is their step T − 1)
            assert ours[s] == pytest.approx(_theirs(s + 1, total, warm, cool, r), rel=1e-12, abs=1e-15), s
    assert ours[-1] == pytest.approx(r, abs=1e-15)
    assert _theirs(total - 1, total, warm, cool, r) == pytest.approx(r + (1 - r) / cool)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 400), warmup_frac=st.floats(0.0, 1.0), decay_frac=st.floats(0.0, 1.0),
       r=st.sampled_from([0.0, 1 / 32, 0.1, 0.5]))
def test_every_step_is_the_smaller_of_the_warmup_ramp_and_the_decay_line(total, warmup_frac, decay_frac, r) -> None:
    """Any run length and fractions (``warmup_frac + decay_frac <= 1``, as ``TrainConfig`` requires): the factor is
    ``min(1, (s + 1) / W, the decay line)`` as the authors' ``min``. A decay over the whole run with a warmup of under
    one step (``W`` forced to 1) overlapped the two at step 0, where the warmup's 1.0 won: ``T = 4, decay_frac = 1``
    gave ``[1.0, 0.5, 0.25, 0.0]``, now ``[0.75, 0.5, 0.25, 0.0]``."""
    assume(warmup_frac + decay_frac <= 1.0)
    warm, cool = max(1, int(total * warmup_frac)), int(total * decay_frac)
    for s in range(total):
        line = 1.0 if cool == 0 or s < total - cool else max(r, 1 - (1 - r) * (s - (total - cool) + 1) / cool)
        assert wsd_lr_factor(s, total, warmup_frac, decay_frac, r) == pytest.approx(min(1.0, (s + 1) / warm, line),
                                                                                    rel=1e-12, abs=1e-15), s
    assert [wsd_lr_factor(s, 4, 0.0, 1.0) for s in range(4)] == [0.75, 0.5, 0.25, 0.0]
