"""Token windows of a corpus, each starting with BOS: what activations are collected on and
evaluations run on (:class:`TokenDataset`), and the loss mask of a batch of windows."""

from __future__ import annotations

from typing import Any

import torch

from .._typing import Int


def _loss_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(batch, pos)`` bool: real tokens except BOS (column 0)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    loss_mask = real.clone()
    loss_mask[:, 0] = False
    return loss_mask


class TokenDataset:
    """A corpus cut into ``(n_windows, seq_len)`` token windows, each starting with BOS.

    Args:
        tokens: ``(n_windows, seq_len)`` int64 token ids.
        target_mask: optional ``(n_windows, seq_len)`` bool — the tokens whose prediction counts in
            the evaluations' CE and KL (e.g. only the answers of a task dataset; column 0 is never
            predicted); default all.

    Raises:
        ValueError: ``tokens`` empty or not 2-D, or ``target_mask`` of another shape.
    """

    def __init__(self, tokens: Int[torch.Tensor, "n seq"], target_mask: torch.Tensor | None = None) -> None:
        if tokens.dim() != 2 or tokens.shape[0] == 0:
            raise ValueError(f"tokens must be a non-empty (n_windows, seq_len) tensor, got {tuple(tokens.shape)}")
        if target_mask is not None and tuple(target_mask.shape) != tuple(tokens.shape):
            raise ValueError(f"target_mask must be {tuple(tokens.shape)} like tokens, got {tuple(target_mask.shape)}")
        self.tokens = tokens
        self.target_mask = None if target_mask is None else target_mask.bool()

    @classmethod
    def from_text(cls, tokenizer: Any, text: str, seq_len: int, bos_token_id: int | None = None) -> TokenDataset:
        """Tokenize ``text`` once (no special tokens) and cut it into windows of ``seq_len``.

        Each window is ``[BOS] + seq_len-1`` corpus tokens (BOS from the tokenizer unless given).
        """
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id if bos_token_id is None else bos_token_id
        body = seq_len - 1 if bos is not None else seq_len
        n = len(ids) // body
        if n == 0:
            raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {seq_len}")
        t = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
        if bos is not None:
            t = torch.cat([torch.full((n, 1), bos, dtype=torch.long), t], dim=1)
        return cls(t)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def split(self, holdout_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """(train, held-out): the last ``holdout_fraction`` of windows are held out."""
        n_hold = max(1, int(len(self) * holdout_fraction))
        m = self.target_mask
        return (TokenDataset(self.tokens[:-n_hold], None if m is None else m[:-n_hold]),
                TokenDataset(self.tokens[-n_hold:], None if m is None else m[-n_hold:]))

    def targets(self, start: int, stop: int) -> torch.Tensor | None:
        """``target_mask`` of windows ``start:stop`` (None: every token counts)."""
        return None if self.target_mask is None else self.target_mask[start:stop]

    def batch(self, index: int, batch_size: int, seed: int = 0) -> Int[torch.Tensor, "batch seq"]:
        """Batch ``index`` of an endless shuffled stream (a new permutation each epoch, from ``seed``):
        the windows :func:`_window_ids` picks."""
        return self.tokens[_window_ids(len(self), index, batch_size, seed)]


def _window_ids(n_windows: int, index: int, batch_size: int, seed: int) -> Int[torch.Tensor, " batch"]:
    """The windows of batch ``index`` of an endless stream over ``n_windows`` windows: a new seeded
    permutation each epoch (``seed * 1_000_003 + epoch``), cut into ``n_windows // batch_size`` batches."""
    per_epoch = max(1, n_windows // batch_size)
    epoch, k = divmod(index, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_windows, generator=g)[k * batch_size:(k + 1) * batch_size]
