"""FVU against dead heads: our trainer and the Lorsa authors' (llamascopium) on the same batches.

Reads ``benchmarks/results/lorsa_frontier.json`` (every measured run of issue 26: one row per run
with ``trainer`` ("ours" / "llamascopium"), ``steps``, ``lr``, ``variant``, held-out ``fvu`` and
``dead_frac``, and the ``command`` that produced it) and draws one panel per budget (steps): each
trainer's points, the lr sweep of each joined by a line, labelled by lr (and by the remedy where one
is on). Lower-left is better on both axes: a point dominates another when its FVU and its dead
fraction are both lower or equal.

    PYTHONPATH=. python benchmarks/lorsa_frontier.py            # writes docs/figures/lorsa_fvu_vs_dead_L2.png
    PYTHONPATH=. python benchmarks/lorsa_frontier.py --table    # the rows as a markdown table, with domination
    PYTHONPATH=. python benchmarks/lorsa_frontier.py --layers   # every layer, three models (..._layers.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "lorsa_frontier.json"
FIGURE = HERE.parent / "docs" / "figures" / "lorsa_fvu_vs_dead_L2.png"
NEW_DEFAULT = "ours, the default (balance kept on, cap 0.5)"
# family -> (colour, marker, alpha): the earlier recipes of ours (issue 26 before the default changed) lighter
STYLE = {NEW_DEFAULT: ("tab:green", "D", 1.0),
         "ours, scale in ||w_o|| (rank_by_decoder_norm=True)": ("tab:blue", "o", 0.45),
         "ours, former default (AuxK, scale in w_v)": ("tab:cyan", "^", 0.45),
         "llamascopium": ("tab:red", "s", 1.0)}


def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a`` is at least as good as ``b`` on both axes (FVU and dead fraction, lower is better)."""
    return bool(a["fvu"] <= b["fvu"] and a["dead_frac"] <= b["dead_frac"])


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["steps"] for r in rows})
    # one panel per budget, then the largest budget again zoomed on FVU < 0.025 (every point but the far ones)
    panels: list[tuple[int, tuple[float, float, float, float] | None]] = [(b, None) for b in budgets]
    panels.append((budgets[-1], (0.0, 92.0, 0.0138, 0.025)))
    from matplotlib.ticker import FormatStrFormatter

    ncols = 2
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 5.0 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (steps, zoom) in zip(axes.flat, panels, strict=False):
        for family, (color, marker, alpha) in STYLE.items():
            pts = [r for r in rows if r["steps"] == steps and r.get("family", r["trainer"]) == family
                   and (zoom is None or (zoom[0] <= 100 * r["dead_frac"] <= zoom[1]
                                         and zoom[2] <= r["fvu"] <= zoom[3]))]
            sweep = sorted((r for r in pts if r.get("sweep") == "lr"), key=lambda r: r["lr"])
            if sweep:
                ax.plot([100 * r["dead_frac"] for r in sweep], [r["fvu"] for r in sweep], color=color,
                        lw=1.6 if alpha == 1.0 else 1, alpha=0.8 * alpha)
            # the balance-strength sweep (balance_max at the default's lr), dashed through the default's point
            cap = sorted((r for r in pts if r.get("balance_max") is not None
                          and (r.get("sweep") == "balance" or r["lr"] == 4e-3)), key=lambda r: r["balance_max"])
            if len(cap) > 1:
                ax.plot([100 * r["dead_frac"] for r in cap], [r["fvu"] for r in cap], color=color, lw=1.2, ls="--",
                        alpha=0.8 * alpha)
            for r in pts:
                hollow = r.get("sweep") != "lr"
                ax.scatter(100 * r["dead_frac"], r["fvu"], color="white" if hollow else color, edgecolor=color,
                           marker=marker, s=40 if alpha == 1.0 else 30, zorder=4 if alpha == 1.0 else 3,
                           alpha=alpha, label=None)
                ax.annotate(r.get("label") or f"lr {r['lr']:g}", (100 * r["dead_frac"], r["fvu"]),
                            fontsize=7 if alpha == 1.0 else 6, xytext=(3, 3), textcoords="offset points",
                            color=color, alpha=max(alpha, 0.7))
            ax.scatter([], [], color=color, marker=marker, alpha=alpha, label=family)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.margins(x=0.12, y=0.12)
        if zoom is not None:
            ax.set_xlim(zoom[0], zoom[1])
            ax.set_ylim(zoom[2], zoom[3])
        ax.set_xlabel("dead heads on held-out tokens (%)")
        ax.set_ylabel("held-out FVU")
        ax.set_title(f"layer 2, {steps} steps ({steps * 16 * 128 / 1e6:.2f}M tokens)" + (", zoom" if zoom else ""))
        ax.grid(alpha=0.3, which="both")
    fig.suptitle("Lorsa, embedded model layer 2 (1024 OV heads, k 16), same batches and held-out tokens; lower-left "
                 "dominates\nfilled + line: lr sweep; hollow: one mechanism changed; green dashed: the default's "
                 "balance cap at lr 4e-3 (cap 0.5 = its lr-4e-3 point); pale: our earlier recipes", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)


LAYERS = HERE / "results" / "lorsa_llamascopium_layers.json"
LAYERS_FIGURE = HERE.parent / "docs" / "figures" / "lorsa_fvu_vs_dead_layers.png"
LAYER_STYLE = {"ours, scale in ||w_o|| (scale_into='w_o')": ("tab:blue", "o"),
               "ours, scale in ||w_o||, lr 2e-3": ("tab:purple", "D"),
               "ours, scale in w_v (the default)": ("tab:cyan", "^"),
               "llamascopium, documented init": ("tab:red", "s")}


def plot_layers(rows: list[dict[str, Any]], out: Path) -> None:
    """One panel per model: each layer's three runs (``lorsa_llamascopium.py collect`` rows), joined by a
    grey line per layer and labelled ``L{layer}``; lower-left dominates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        here = [r for r in rows if r["model"] == model]
        for layer in sorted({r["layer"] for r in here}):
            pts = sorted((r for r in here if r["layer"] == layer), key=lambda r: r["dead_frac"])
            ax.plot([100 * r["dead_frac"] for r in pts], [r["fvu"] for r in pts], color="grey", lw=0.7, alpha=0.6)
        for label, (color, marker) in LAYER_STYLE.items():
            pts = [r for r in here if r["label"] == label]
            ax.scatter([100 * r["dead_frac"] for r in pts], [r["fvu"] for r in pts], color=color, marker=marker,
                       s=36, zorder=3, label=label)
            for r in pts:
                ax.annotate(f"L{r['layer']}", (100 * r["dead_frac"], r["fvu"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points", color=color)
        ax.set_yscale("log")
        ax.margins(x=0.12, y=0.15)
        ax.set_xlabel("dead heads on held-out tokens (%)")
        ax.set_ylabel("held-out FVU")
        steps = sorted({r["steps"] for r in here})
        ax.set_title(f"{model} ({here[0]['model_type']}), {'/'.join(map(str, steps))} steps")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle("Lorsa per layer, 1024 OV heads, k 16, lr 4e-3 unless marked, same batches and held-out tokens; "
                 "lower-left dominates; grey: one layer",
                 fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(LAYER_STYLE), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)


def table(rows: list[dict[str, Any]]) -> str:
    def name(r: dict[str, Any]) -> str:
        return r["variant"] if r["trainer"] != "ours" else f"{r.get('family', 'ours')}: {r['variant']}"

    lines = ["| steps | trainer | family | variant | lr | FVU | dead | dominated by |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["steps"], r["trainer"], r.get("family", ""), r["lr"], r["variant"])):
        rivals = [o for o in rows if o["steps"] == r["steps"] and o["trainer"] != r["trainer"] and dominates(o, r)]
        by = ", ".join(f"`{name(o)}`" for o in rivals) or "-"
        lines.append(f"| {r['steps']} | {r['trainer']} | {r.get('family', r['trainer'])} | `{r['variant']}` | "
                     f"{r['lr']:g} | {r['fvu']:.4f} | {100 * r['dead_frac']:.1f}% | {by} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--out", default=str(FIGURE))
    p.add_argument("--table", action="store_true", help="print the rows as markdown instead of plotting")
    p.add_argument("--layers", action="store_true",
                   help=f"the per-layer head-to-head ({LAYERS.name}) into {LAYERS_FIGURE.name} instead")
    args = p.parse_args()
    if args.layers:
        plot_layers(json.loads(LAYERS.read_text())["rows"], LAYERS_FIGURE)
        print(LAYERS_FIGURE)
        return
    rows = [r for r in json.loads(Path(args.results).read_text())["rows"] if r.get("layer", 2) == 2]
    if args.table:
        print(table(rows))
    else:
        plot(rows, Path(args.out))
        print(args.out)


if __name__ == "__main__":
    main()
