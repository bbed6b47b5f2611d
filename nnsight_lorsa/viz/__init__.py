"""Local visualisation: static HTML head dashboards (Lorsa paper Fig. 4), the attribution-graph viewer and
matplotlib figures.

:func:`head_dashboard_data` / :func:`write_dashboard` — one Lorsa head's top activations, z-patterns
and OV logit lens as a self-contained HTML page; :func:`render_html` — an attribution graph in the
viewer (zoom, fit to width, legend, a side panel per node); :func:`plot_z_pattern`,
:func:`plot_operand_grid`, :func:`plot_heads_spanned`, :func:`plot_graph`,
:func:`plot_training_curves` — figures (PNG through matplotlib). Pages are self-contained (no network);
their scripts are package files in ``nnsight_lorsa/viz/static/``.
"""

from .dashboard import head_dashboard_data, render_dashboard, write_dashboard
from .figures import plot_heads_spanned, plot_operand_grid, plot_training_curves, plot_z_pattern
from .graph_plot import plot_graph
from .graph_viewer import TrustedHTML, render_html
from .page import token_pieces

__all__ = ["TrustedHTML", "head_dashboard_data", "plot_graph", "plot_heads_spanned", "plot_operand_grid",
           "plot_training_curves", "plot_z_pattern", "render_dashboard", "render_html", "token_pieces",
           "write_dashboard"]
