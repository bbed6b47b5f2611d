"""Mutation probe, round 11b (docs/reliability.md): what a Ctrl-C before the first step saves and the printed
context of a head's top activation. Each test was seen failing with a one-line mutant of ``demo.py`` that the default
tests let through; the references are the documented rules (``TrainingInterrupted``'s docstring; every window starts
with the model's BOS, which is not text), written out here by hand."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import nnsight_lorsa.demo as demo


def test_a_ctrl_c_before_the_first_step_saves_nothing_even_with_the_scales_estimated(tmp_path):
    """``TrainingInterrupted.checkpoint``: "None when the interrupt came before the first step (nothing trained,
    nothing saved)" — also when the first step had already estimated the scale factors (``s_in`` set) when Ctrl-C
    came."""
    saved: list[object] = []
    trainer = SimpleNamespace(step=0, s_in=1.0, s_out=1.0, save_checkpoint=saved.append,
                              folded=lambda: saved.append("folded"))
    got = demo._save_interrupted(trainer, object(), 0, tmp_path)
    assert (got.checkpoint, got.lorsa, got.step) == (None, None, 0)
    assert saved == [] and list(tmp_path.iterdir()) == []


class _Tok:
    """Decodes id ``i`` as ``<i>``: what is shown is exactly which ids were decoded."""

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def test_the_printed_context_starts_after_the_windows_bos():
    """``_context``: up to 12 ids left of the position (never position 0, the window's BOS), ``[[`` the token ``]]``,
    then 3 ids right."""
    ids = torch.tensor([1, 10, 11, 12, 13, 14])  # 1: BOS at position 0
    assert demo._context(_Tok(), ids, 2) == "<10>[[<11>]]<12><13><14>"
    assert demo._context(_Tok(), ids, 1) == "[[<10>]]<11><12><13>"
    long = torch.tensor([1, *range(20, 40)])
    assert demo._context(_Tok(), long, 15) == "".join(f"<{i}>" for i in range(22, 34)) + "[[<34>]]<35><36><37>"
