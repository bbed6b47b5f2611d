"""Host-memory housekeeping outside the package's own arithmetic: giving the C heap's free pages back.

Kept apart from the attribution code that calls it so that no C-library handle is a global of a module whose
functions may be serialized by value (nnsight pickles trace code with its globals; a ``ctypes`` handle cannot
be pickled), and so that ``ctypes`` is imported only when the call is made.
"""

from __future__ import annotations


def release_free_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Attribution frees each batch's temporaries (gradients, masks, indices: megabytes) while a few small
    long-lived allocations land between them; glibc then keeps the holes resident and the process's peak
    grows with every batch although the live data does not (measured: 2.7 MB per batch at 128 tokens,
    0.8 MB of it stored entries). A call walks the heap (~50 ms at a few hundred MB); callers space them
    (``attribution.rows.TRIM_EVERY``). The C library is opened per call (``dlopen`` of the running program:
    microseconds), never held.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
    except (ImportError, OSError):  # pragma: no cover - no ctypes / no C library handle on this platform
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:  # glibc only
        trim(0)
