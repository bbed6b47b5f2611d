"""The Lorsa recipe's SVD init per MHSA head: the factored SVD against the SVD of the full product.

    python -m benchmarks.lorsa_init_principal_directions [--threads 2] [--repeats 3]

``training.lorsa_recipe._principal_directions(coeffs, basis, n)`` computes the top right singular vectors of one
MHSA head's demeaned values ``x W_V W_Vᵀ`` (``value_svd``) or outputs ``A x W_V W_O`` (``output_svd``) — a
``(tokens, d_model)`` matrix of rank ``≤ d_head`` — from the SVD of its ``(tokens, d_head)`` factor mapped back
through the basis' QR. Until 2026-11-26 it took the SVD of the product itself (``full``, re-implemented here as the
reference). Per shape ``(tokens, d_model, d_head)``: the median seconds of each (interleaved repeats, float64 on
the CPU as the recipe computes), their ratio, and the largest difference of the two fp32 bases (both signed
canonically). Writes ``benchmarks/results/lorsa_init_principal_directions.json``.
"""

from __future__ import annotations

import functools

import torch

from benchmarks._timing import command, parser, start, time_interleaved, write
from nnsight_lorsa.training.lorsa_recipe import _principal_directions

SHAPES = [(2048, 512, 64), (4096, 1024, 64), (4096, 2048, 128)]


def full(values: torch.Tensor, n: int) -> torch.Tensor:
    """The former computation: the SVD of the demeaned ``(tokens, d)`` product, signed canonically."""
    v = values.double()
    v = v - v.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(v, full_matrices=False)
    vh = vh[:n]
    sign = vh.gather(1, vh.abs().argmax(1, keepdim=True)).sign()
    return (vh * torch.where(sign == 0, torch.ones_like(sign), sign)).float()


def full_of(coeffs: torch.Tensor, basis: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`full` of the product ``coeffs @ basis`` (formed in fp32, as the recipe formed it)."""
    return full(coeffs @ basis, n)


def main() -> None:
    args = parser(__doc__, threads=2, repeats=3, warmup=1, name="lorsa_init_principal_directions").parse_args()
    start(args)
    g = torch.Generator().manual_seed(0)
    rows = []
    for tokens, d, e in SHAPES:
        x = torch.randn(tokens, d, generator=g)
        W = torch.randn(d, e, generator=g) / d**0.5
        xw = x @ W
        variants = {"full": functools.partial(full_of, xw, W.T, e),
                    "factored": functools.partial(_principal_directions, xw, W.T, e)}
        times = time_interleaved(variants, repeats=args.repeats, warmup=args.warmup)
        diff = float((full_of(xw, W.T, e) - _principal_directions(xw, W.T, e)).abs().max())
        row = {"tokens": tokens, "d_model": d, "d_head": e, "full_s": times["full"]["median_s"],
               "factored_s": times["factored"]["median_s"],
               "factored_over_full": times["factored"]["median_s"] / times["full"]["median_s"],
               "max_abs_basis_diff": diff}
        print(row, flush=True)
        rows.append(row)
    print("wrote", write(args.name, {"command": command(), "rows": rows}))


if __name__ == "__main__":
    main()
