"""A ``__repr__`` for dataclasses that travel by value to an NDIF server.

The ``__repr__`` that ``@dataclass`` generates is wrapped by ``dataclasses._recursive_repr``,
which closes over ``_thread.get_ident``; pickled by value, it drags ``_thread`` into the request,
and NDIF's unpickler allows only a whitelist of modules. Classes shipped in traces therefore use
``@dataclass(repr=False)`` and inherit this plain one.
"""

from __future__ import annotations

import dataclasses


class FieldsRepr:
    """``ClassName(field=value, ...)`` over the dataclass fields that have ``repr=True``."""

    def __repr__(self) -> str:
        parts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr)  # type: ignore[arg-type]
        return f"{type(self).__name__}({parts})"
