"""Top-activating contexts of every Lorsa head over a corpus, streaming with bounded memory.

For each of the ``n_ov_heads`` heads keep the ``n_top`` largest activations ``z`` seen so far
with their (window, position): memory ``O(n_ov_heads × n_top)`` whatever the corpus size
(Lorsa paper §5.1 "top activations"; the dashboards of Fig. 4 are built from these).

With ``distinct_windows`` a head keeps at most one entry per window (its largest activation there):
neighbouring positions of one window show the same stretch of text, and a dashboard listing the same
window three times shows one context, not three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import is_int
from .._typing import Float
from ..errors import ArgumentError


@dataclass
class TopActivations:
    """Running top-``n_top`` activations per head.

    Attributes:
        values: ``(n_heads, n_top)`` activations, descending (``-inf`` where fewer were seen).
        window: ``(n_heads, n_top)`` int64 window (row) index in the corpus, ``-1`` if empty.
        position: ``(n_heads, n_top)`` int64 token position in the window.
        count: ``(n_heads,)`` int64 number of tokens where the head was active (``z > 0``).
        n_tokens: tokens seen.
        distinct_windows: keep at most one entry per (head, window), the window's largest activation
            (window indices are the corpus rows given to :meth:`update`).

    Source: Lorsa paper (He et al. 2025) §5.1 (top activations of a head).
    """

    values: torch.Tensor
    window: torch.Tensor
    position: torch.Tensor
    count: torch.Tensor
    n_tokens: int = 0
    distinct_windows: bool = False

    @classmethod
    def empty(cls, n_heads: int, n_top: int, *, distinct_windows: bool = False) -> TopActivations:
        """An empty table of ``n_top`` entries for each of ``n_heads`` heads (on the host).

        Raises:
            ArgumentError: ``n_heads`` or ``n_top`` not a positive int.

        Source: Lorsa paper (He et al. 2025) §5.1 (top activations of a head).
        """
        for name, value in (("n_heads", n_heads), ("n_top", n_top)):
            if not is_int(value) or value < 1:
                raise ArgumentError(f"TopActivations.empty: {name} must be a positive int, got {value!r}")
        # host-side tables: update() brings each batch's activations to the CPU
        return cls(distinct_windows=bool(distinct_windows),
            values=torch.full((n_heads, n_top), float("-inf"), dtype=torch.float32, device="cpu"),
            window=torch.full((n_heads, n_top), -1, dtype=torch.long, device="cpu"),
            position=torch.full((n_heads, n_top), -1, dtype=torch.long, device="cpu"),
            count=torch.zeros(n_heads, dtype=torch.long, device="cpu"),
        )

    @torch.no_grad()
    def update(self, z: Float[torch.Tensor, "batch pos n_heads"], first_window: int,
               keep: torch.Tensor | None = None) -> None:
        """Merge a batch of activations; ``first_window`` is the corpus index of ``z[0]``.

        ``keep``: optional ``(batch, pos)`` bool mask of tokens to consider (e.g. not BOS). Both may be
        on any device and ``z`` in any dtype: they are compared in fp32 on the CPU, where the table lives.

        Raises:
            ArgumentError: ``z`` not a ``(batch, pos, n_heads)`` float tensor of this table's ``n_heads``, or
                holding NaN or ±inf at a kept token (NaN and inf would rank above every activation, -inf read as an
                empty slot; values where ``keep`` is False are not read: padding may hold anything);
                ``keep`` not ``(batch, pos)``;
                ``first_window`` not an int ``>= 0``.

        Source: Lorsa paper (He et al. 2025) §5.1 (top activations of a head).
        """
        n_heads = self.values.shape[0]
        if not isinstance(z, torch.Tensor) or z.dim() != 3 or z.shape[-1] != n_heads or not z.dtype.is_floating_point:
            got = f"{tuple(z.shape)} {z.dtype}" if isinstance(z, torch.Tensor) else type(z).__name__
            raise ArgumentError(f"TopActivations.update: z must be a float tensor (batch, pos, n_heads={n_heads}), "
                                f"got {got}")
        if not is_int(first_window) or first_window < 0:
            raise ArgumentError(f"TopActivations.update: first_window must be an int >= 0, got {first_window!r}")
        b, s, n = z.shape
        if keep is not None and (not isinstance(keep, torch.Tensor) or tuple(keep.shape) != (b, s)):
            keep_got = tuple(keep.shape) if isinstance(keep, torch.Tensor) else type(keep).__name__
            raise ArgumentError(f"TopActivations.update: keep must be a (batch, pos) = {(b, s)} mask, got {keep_got}")
        z = z.detach().float().cpu()
        kept = None if keep is None else keep.cpu().bool()
        if not bool(torch.isfinite(z if kept is None else z[kept]).all()):  # values at left-out tokens are not read
            raise ArgumentError("TopActivations.update: z holds NaN or inf activations (NaN and inf would rank first, "
                                "-inf reads as an empty slot; an inf is an overflow, e.g. of an fp16 Lorsa): check the "
                                "model / Lorsa for non-finite values")
        if kept is not None:
            z = z.masked_fill(~kept[..., None], float("-inf"))
        flat = z.reshape(b * s, n)
        self.count += (flat > 0).sum(0)
        self.n_tokens += int(keep.sum() if keep is not None else b * s)
        n_top = self.values.shape[1]
        if self.distinct_windows:  # each window's best position first, then the best windows
            per_window, best_pos = z.max(dim=1)  # (b, n)
            vals, rows = per_window.topk(min(n_top, b), dim=0)  # (m, n)
            win, pos = rows + first_window, best_pos.gather(0, rows)
        else:
            vals, idx = flat.topk(min(n_top, b * s), dim=0)  # (m, n)
            win, pos = idx // s + first_window, idx % s
        cand_v = torch.cat([self.values, vals.T], dim=1)
        cand_w = torch.cat([self.window, win.T], dim=1)
        cand_p = torch.cat([self.position, pos.T], dim=1)
        if self.distinct_windows:  # a window given again (overlapping updates): its best entry only
            order = cand_v.argsort(dim=1, descending=True, stable=True)
            cand_v, cand_w, cand_p = cand_v.gather(1, order), cand_w.gather(1, order), cand_p.gather(1, order)
            c = cand_w.shape[1]
            earlier = torch.ones(c, c, dtype=torch.bool, device=cand_w.device).tril(-1)
            dup = ((cand_w[:, :, None] == cand_w[:, None, :]) & earlier).any(-1) & (cand_w >= 0)
            cand_v = cand_v.masked_fill(dup, float("-inf"))
        top_v, order = cand_v.topk(n_top, dim=1)
        empty = top_v == float("-inf")  # nothing kept there (masked tokens, duplicates): no window
        self.values = top_v
        self.window = cand_w.gather(1, order).masked_fill(empty, -1)
        self.position = cand_p.gather(1, order).masked_fill(empty, -1)

    @property
    def frequency(self) -> torch.Tensor:
        """``(n_heads,)`` fraction of tokens on which each head is active.

        Source: Lorsa paper (He et al. 2025) §5.1 (top activations of a head).
        """
        return self.count.float() / max(self.n_tokens, 1)

    def top_heads(self, n: int) -> list[int]:
        """The ``n`` heads with the largest maximum activation among heads that fired at all (fewer where fewer
        fired: a head that never did is not listed), best first, heads of equal maximum by index.

        Raises:
            ArgumentError: ``n`` not an int ``>= 0``.

        Source: Lorsa paper (He et al. 2025) §5.1 (top activations of a head).
        """
        if not is_int(n) or n < 0:
            raise ArgumentError(f"TopActivations.top_heads: n must be an int >= 0, got {n!r}")
        fired = (self.count > 0).nonzero().flatten()
        order = self.values[fired, 0].argsort(descending=True, stable=True)  # stable: equal maxima by head index
        return fired[order][:n].tolist()
