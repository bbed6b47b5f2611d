"""Mutation probe, round 10 (docs/reliability.md, "Mutation probe, round 10: head analysis, figures, dashboards and
the CLI"): what the figures and the head dashboard show where their tests left it open, read back from the
matplotlib artists (``figures._save`` replaced) and from the dashboard's dict, against the documented rules.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from nnsight_lorsa.viz import figures


class _Capture:
    """The figures' ``_save`` replaced: keep the figure to read its artists (no PNG written)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.figs: list = []
        monkeypatch.setattr(figures, "_save", lambda fig, path: (self.figs.append(fig), Path(path))[1])

    @property
    def fig(self):  # type: ignore[no-untyped-def]
        return self.figs[-1]


def test_z_pattern_scale_holds_a_largest_value_that_is_negative(monkeypatch):
    """The z-pattern's colour scale is ``±max |zp|`` (documented): a pattern whose largest magnitude is a key lowering
    z (-3) is drawn on (-3, 3), not clipped (seen failing: ``max(zp)`` gave (-0.5, 0.5), the -3 cell the same colour
    as -0.5)."""
    cap = _Capture(monkeypatch)
    zp = torch.tensor([[0.5, 0.0, 0.0], [-3.0, 0.25, 0.0], [0.1, -1.0, 0.2]])
    figures.plot_z_pattern(zp, ["a", "b", "c"], "unused.png")
    assert cap.fig.axes[0].images[0].get_clim() == (-3.0, 3.0)
    plt.close("all")


def test_operand_grid_with_a_zero_and_no_negative_is_on_viridis_over_its_range(monkeypatch):
    """Documented: ``viridis`` over the data's range where no value is negative (a grid of probabilities or counts
    with a 0 cell), ``RdBu_r`` only for a signed one (seen failing: ``lo <= 0`` put it on ``RdBu_r`` from -4 to 4)."""
    cap = _Capture(monkeypatch)
    g = torch.tensor([[0.0, 1.0], [2.5, 4.0]])
    figures.plot_operand_grid(g, "unused.png", operands=[0, 1])
    img = cap.fig.axes[0].images[0]
    assert img.get_cmap().name == "viridis"
    assert img.get_clim() == (0.0, 4.0)
    plt.close("all")


def test_operand_grid_with_repeated_operands_labels_the_cells(monkeypatch):
    """Repeated operands (``[2, 2, 2]``: a step of 0) are no evenly spaced axis: the cells keep their default extent
    and the ticks name their operands (seen failing: an extent of width 0, every cell drawn at 2)."""
    cap = _Capture(monkeypatch)
    figures.plot_operand_grid(torch.rand(3, 3), "unused.png", operands=[2, 2, 2])
    ax = cap.fig.axes[0]
    left, right, bottom, top = ax.images[0].get_extent()
    assert (right - left, bottom - top) == (3.0, 3.0)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "2", "2"]
    assert list(ax.get_xticks()) == [0, 1, 2]
    plt.close("all")


def _panels(cap: _Capture) -> dict[str, plt.Axes]:
    return {ax.get_title(): ax for ax in cap.fig.axes if ax.axison}


def test_training_curves_one_panel_per_metric_in_the_documented_order(monkeypatch):
    """One panel per numeric metric (bools are no metric), ``loss, fvu, l0, dead_frac, lr`` first and then the rest
    sorted; each panel's line is its finite (step, value) points, plain Python here (seen failing: ``sorted(keys)``
    put ``aux`` first; ``len(names) // cols`` rows dropped the 4th and 5th panels; a bool flag drawn as a panel)."""
    cap = _Capture(monkeypatch)
    history = [{"step": s, "loss": 2.0 / (s + 1), "l0": 4.0 + s, "aux": 0.1 * s, "zeta": float(s),
                "fvu": float("nan") if s == 2 else 0.5 / (s + 1), "resampled": s % 2 == 0} for s in range(5)]
    figures.plot_training_curves(history, "unused.png")
    titles = [ax.get_title() for ax in cap.fig.axes if ax.axison]
    assert titles == ["loss", "fvu", "l0", "aux", "zeta"]
    panels = _panels(cap)
    for name, ax in panels.items():
        want = [(float(e["step"]), float(e[name])) for e in history if np.isfinite(e[name])]
        (line,) = ax.get_lines()
        assert list(zip(line.get_xdata(), line.get_ydata(), strict=True)) == want, name
    plt.close("all")


def test_training_curves_log_scale_only_where_every_value_is_positive(monkeypatch):
    """``loss`` and ``fvu`` on a log scale where all positive (documented): an fvu reaching 0 stays linear (seen
    failing: ``any`` put it on a log axis, where the 0 cannot be drawn); ``l0`` always linear."""
    cap = _Capture(monkeypatch)
    history = [{"step": s, "loss": 1.0 / (s + 1), "fvu": 0.5 - 0.25 * s, "l0": 3.0} for s in range(3)]
    figures.plot_training_curves(history, "unused.png")
    panels = _panels(cap)
    assert {name: ax.get_yscale() for name, ax in panels.items()} == {"loss": "log", "fvu": "linear",
                                                                     "l0": "linear"}
    plt.close("all")


# ----------------------------------------------------------------------------- the head dashboard
@pytest.fixture(scope="module")
def tiny_dashboard():
    from helpers import LAYER, make_lorsa, random_ids, tiny_nnsight

    from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
    from nnsight_lorsa.analysis.heads import collect_top_activations

    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model))
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    tokens = random_ids(batch=6, seq=10, seed=7)
    top = collect_top_activations(rm, LAYER, tokens, n_top=4)
    g = lorsa.cfg.group_size
    # a head with 3+ distinct active windows, whose QK head (h // g) is not h % g and whose frequency is not that
    # of head LAYER (so a head or a key mixed up shows)
    head = next(h for h in top.top_heads(lorsa.cfg.n_ov_heads)
                if len({w for w, v in zip(top.window[h].tolist(), top.values[h].tolist(), strict=True)
                        if w >= 0 and v > 0}) >= 3 and h // g != h % g
                and float(top.frequency[h]) != float(top.frequency[LAYER]))
    return rm, lorsa, tokens, top, head, LAYER


def test_dashboard_header_and_contexts_are_the_heads(tiny_dashboard):
    """The header's numbers are the head's (``frequency``, ``n_tokens`` of ``top``; ``qk_head = head // group_size``,
    docs/analysis.md), at most ``n_contexts`` contexts, the best distinct windows first, and ``window`` tokens before
    the query (seen failing: ``len(contexts) > n_contexts`` showed 3 of 2; ``head % group_size``; the frequency of
    head ``layer``)."""
    from nnsight_lorsa.viz.dashboard import head_dashboard_data

    rm, lorsa, tokens, top, head, layer = tiny_dashboard
    d = head_dashboard_data(rm, layer, head, top, tokens, n_contexts=2, window=3, lens_k=2)
    assert d["qk_head"] == head // lorsa.cfg.group_size
    assert d["frequency"] == float(top.frequency[head]) and d["n_tokens"] == int(top.n_tokens)
    seen: list[int] = []
    for v, w in zip(top.values[head].tolist(), top.window[head].tolist(), strict=True):
        if w >= 0 and v > 0 and w not in seen:
            seen.append(w)
    assert [c["window"] for c in d["contexts"]] == seen[:2]
    for c in d["contexts"]:
        assert len(c["tokens"]) == len(c["contrib"]) == min(c["position"], 3) + 1


def test_dashboard_q_and_k_rows_are_the_query_and_key_features(tiny_dashboard):
    """App. F.1: the ``Q`` rows are ``top_query_features``, the ``K`` rows ``top_key_features`` (seen failing: the
    two aspects' labels swapped — a dashboard's own test has 3 of each, so only the counts were read)."""
    from nnsight_lorsa.analysis import QKFeatureImpacts
    from nnsight_lorsa.viz.dashboard import head_dashboard_data

    rm, _, tokens, top, head, layer = tiny_dashboard

    class QK(QKFeatureImpacts):  # a QKFeatureImpacts with hand-set rows (the dashboard refuses other kinds)
        def __init__(self) -> None:  # noqa: D107 — no dataclass fields: only what the dashboard reads
            self.layer, self.head = layer, head

        def top_query_features(self, n: int) -> list[tuple[int, float, int, int]]:
            return [(11, 0.5, 0, 1), (12, 0.25, 0, 2)][:n]

        def top_key_features(self, n: int) -> list[tuple[int, float, int, int]]:
            return [(21, 0.125, 1, 3)][:n]

    d = head_dashboard_data(rm, layer, head, top, tokens, n_contexts=1, lens_k=1, qk_features=QK())
    assert [(r["aspect"], r["feature"], r["score"]) for r in d["sae_features"]] == [
        ("Q", 11, 0.5), ("Q", 12, 0.25), ("K", 21, 0.125)]


def test_dashboard_of_a_head_never_active_in_the_correlation_has_no_mhsa_section(tiny_dashboard):
    """``mhsa_correlation`` measured a head on the tokens where it was active; a head active on none (``count`` 0,
    ``heads_spanned`` 0: "never active", App. E.2 as documented) has no coefficients to list: no MHSA section and no
    span (seen failing: a section of zero coefficients with fractions "n/a" and "spans 0 MHSA head(s)"); the same
    head with a count lists its heads, largest mean coefficient first."""
    from nnsight_lorsa.analysis.heads import MHSACorrelation
    from nnsight_lorsa.viz.dashboard import head_dashboard_data

    rm, lorsa, tokens, top, head, layer = tiny_dashboard
    contrib = torch.zeros(lorsa.cfg.n_ov_heads, 4)
    count = torch.zeros(lorsa.cfg.n_ov_heads, dtype=torch.long)
    never = MHSACorrelation(contrib, count, 10)
    d = head_dashboard_data(rm, layer, head, top, tokens, n_contexts=1, lens_k=1, correlation=never)
    assert "mhsa" not in d and "heads_spanned" not in d
    contrib[head] = torch.tensor([0.125, 0.5, 0.25, 0.125])
    count[head] = 3
    d = head_dashboard_data(rm, layer, head, top, tokens, n_contexts=1, lens_k=1,
                            correlation=MHSACorrelation(contrib, count, 10))
    assert [r["head"] for r in d["mhsa"]][:2] == [f"L{layer}.1", f"L{layer}.2"] and d["heads_spanned"] == 4


def test_dashboard_page_marks_the_query_as_each_contexts_last_token(tiny_dashboard, tmp_path):
    """The query token (where z is read: the last of a context's tokens) is the one outlined (``tok query``), in
    every context (seen failing: the first token outlined; the count of outlined tokens was all a test read)."""
    import html
    import re

    from helpers import render_dom, require_chromium

    from nnsight_lorsa.viz.dashboard import head_dashboard_data, write_dashboard

    require_chromium()
    rm, _, tokens, top, head, layer = tiny_dashboard
    d = head_dashboard_data(rm, layer, head, top, tokens, n_contexts=3, window=4, lens_k=1)
    dom = render_dom(write_dashboard(tmp_path / "h.html", d))
    rows = re.findall(r'<div class="ctx">(.*?)</div>', dom, re.S)
    assert len(rows) == len(d["contexts"]) == 3
    for row, c in zip(rows, d["contexts"], strict=True):
        spans = re.findall(r'<span class="(tok[^"]*)"[^>]*>([^<]*)</span>', row)
        assert [cls for cls, _ in spans] == ["tok"] * (len(c["tokens"]) - 1) + ["tok query"]
        assert html.unescape(spans[-1][1]) == c["tokens"][-1].replace("\n", "\u23ce")


# ----------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("old", [["--resume", "old dir/checkpoint"], ["--resume=old dir/checkpoint"]],
                         ids=["separate", "joined"])
def test_the_resume_command_of_a_resumed_run_parses_to_the_new_checkpoint(old):
    """A run resumed and interrupted again prints a command that resumes from the new checkpoint: argparse reads it
    back with every other argument as given and ``--resume`` the new one (seen failing: the old ``--resume``'s value
    kept as a stray argument — ``unrecognized arguments``, the printed command does not run)."""
    import shlex

    from nnsight_lorsa.cli import _parser, _resume_command

    argv = ["demo", "--steps", "3", *old, "--lr", "0.01"]
    cmd = _resume_command(argv, "new dir/checkpoint")
    words = shlex.split(cmd)
    assert words[0] == "nnsight-lorsa" and words.count("--resume") == 1
    args = _parser()[0].parse_args(words[1:])
    assert (args.command, args.steps, args.lr, args.resume) == ("demo", 3, 0.01, "new dir/checkpoint")


def test_the_demos_flags_default_as_their_help_says():
    """``--no-progress`` / ``--no-pictures``: the bar and the pictures are on by default ("default: shown" /
    "written") and off with the flag; ``--overwrite`` off by default (seen failing: ``--no-progress`` as
    ``store_true`` — no bar by default, a bar with the flag)."""
    from nnsight_lorsa.cli import _parser

    parser = _parser()[0]
    plain, off = parser.parse_args(["demo"]), parser.parse_args(["demo", "--no-progress", "--no-pictures"])
    assert (plain.progress, plain.pictures, plain.overwrite) == (True, True, False)
    assert (off.progress, off.pictures) == (False, False)
