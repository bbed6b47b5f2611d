"""A CPU proxy for the device→host synchronisations of attribution's per-batch loop.

On a GPU, host code that reads a device tensor's value (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(t)``, ``int(t)``, a data-dependent shape: ``nonzero``, boolean-mask indexing, ``unique``, …) waits
for every queued kernel: the GPU idles while the host catches up. On CPU nothing is a real sync, so
:func:`count_syncs` counts the *calls* that would be one, on any tensor, but only inside the per-batch
loop: a batch runs from one :meth:`.rows.RowScheduler.next_rows` call to the next (the selection of the
next rows, the backward and the storage of the computed rows), the loop's last ``next_rows`` (which
returns nothing) included in the last batch. The frozen forward before the first batch and the assembly
after the last are per prompt, not counted.

Each count carries its call site (the first frame in ``nnsight_lorsa``, else the innermost outside torch)
so a summary names where the syncs come from.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

#: ``torch.Tensor`` methods that read a value on the host (always a sync on a device tensor)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
              "unique", "masked_select")
#: ``torch`` functions with a data-dependent output shape
SHAPE_FUNCTIONS = ("nonzero", "unique", "masked_select", "argwhere")


@dataclass
class SyncCounts:
    """Sync points counted per batch: ``per_batch[i]`` the count of batch ``i``, ``sites`` ``(kind, site)`` →
    count over every batch."""

    per_batch: list[int] = field(default_factory=list)
    sites: collections.Counter = field(default_factory=collections.Counter)
    _in_batch: bool = False

    @property
    def max_per_batch(self) -> int:
        return max(self.per_batch, default=0)

    def top(self, n: int = 10) -> list[dict[str, Any]]:
        return [{"kind": k, "site": s, "count": c} for (k, s), c in self.sites.most_common(n)]

    def summary(self) -> dict[str, Any]:
        n = len(self.per_batch)
        return {"batches": n, "per_batch": self.per_batch, "max_per_batch": self.max_per_batch,
                "mean_per_batch": round(sum(self.per_batch) / n, 2) if n else 0.0, "top_sites": self.top()}


def _site() -> str:
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if "nnsight_lorsa" in f.filename and "_sync_points" not in f.filename:
            return f"{f.filename.split('nnsight_lorsa/')[-1]}:{f.lineno} {f.name}"
    for f in reversed(frames):
        if "/torch/" not in f.filename and "_sync_points" not in f.filename:
            return f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
    return "?"


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in items)


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounts]:
    """Count, per batch of attribution rows, the calls that are a device→host sync on a GPU (see the module).
    ``.to``/``.copy_`` to the host count as one when the source is not on the CPU (on CPU: never)."""
    from nnsight_lorsa.attribution import rows as rows_mod

    counts = SyncCounts()
    depth = [0]  # inside a counted call: its own internal calls are not counted again

    def note(kind: str) -> None:
        if counts._in_batch and depth[0] == 0:
            counts.per_batch[-1] += 1
            counts.sites[(kind, _site())] += 1

    def wrap(orig: Any, kind: str, when: Any = None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0 and (when is None or when(*args, **kwargs)):
                note(kind)
            depth[0] += 1
            try:
                return orig(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    def to_host(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        if self.device.type == "cpu":
            return False
        target = kwargs.get("device", args[0] if args else None)
        return target is not None and not isinstance(target, torch.dtype) and torch.device(target).type == "cpu"

    patches: list[tuple[Any, str, Any]] = []
    for name in HOST_READS:
        patches.append((torch.Tensor, name, wrap(getattr(torch.Tensor, name), f"Tensor.{name}")))
    patches.append((torch.Tensor, "to", wrap(torch.Tensor.to, "Tensor.to(cpu)", to_host)))
    patches.append((torch.Tensor, "__getitem__", wrap(torch.Tensor.__getitem__, "bool-mask index",
                                                      lambda self, index: _bool_index(index))))
    patches.append((torch.Tensor, "__setitem__", wrap(torch.Tensor.__setitem__, "bool-mask index_put",
                                                      lambda self, index, value: _bool_index(index))))
    for name in SHAPE_FUNCTIONS:
        patches.append((torch, name, wrap(getattr(torch, name), f"torch.{name}")))
    patches.append((torch, "repeat_interleave", wrap(
        torch.repeat_interleave, "repeat_interleave (no output_size)",
        lambda *a, **k: "output_size" not in k and len(a) > 1 and isinstance(a[1], torch.Tensor))))

    orig_next = rows_mod.RowScheduler.next_rows

    def next_rows(self: Any, batch: int) -> list[int]:
        # a batch starts here and ends at the next call; the loop's last call (it returns []) counts in the last batch
        counts.per_batch.append(0)
        counts._in_batch = True
        out = orig_next(self, batch)
        if not out:
            if len(counts.per_batch) > 1:
                counts.per_batch[-2] += counts.per_batch.pop()
            counts._in_batch = False
        return out

    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        rows_mod.RowScheduler.next_rows = next_rows  # type: ignore[method-assign]
        yield counts
    finally:
        rows_mod.RowScheduler.next_rows = orig_next  # type: ignore[method-assign]
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        counts._in_batch = False
