"""The package version (one place: the top level and the graph exports read it)."""

__version__ = "0.1.0"
