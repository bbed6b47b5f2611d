"""Local visualisation: static HTML head dashboards (Lorsa paper Fig. 4) and matplotlib figures.

:func:`head_dashboard_data` / :func:`write_dashboard` — one Lorsa head's top activations, z-patterns
and OV logit lens as a self-contained HTML page; :func:`plot_z_pattern`, :func:`plot_operand_grid`,
:func:`plot_heads_spanned`, :func:`plot_graph` — figures (PNG/SVG through matplotlib).
"""

from .dashboard import head_dashboard_data, render_dashboard, write_dashboard
from .figures import plot_heads_spanned, plot_operand_grid, plot_z_pattern
from .graph_plot import plot_graph

__all__ = ["head_dashboard_data", "plot_graph", "plot_heads_spanned", "plot_operand_grid", "plot_z_pattern",
           "render_dashboard", "write_dashboard"]
