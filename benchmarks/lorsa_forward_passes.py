"""Passes over memory in one Lorsa forward (no autograd), before -> after the RoPE table form, without a GPU.

The H200 profile of the forward at the Llama-3.1-8B shape (``results/lorsa_forward_variants_8b_NVIDIA_H200.json``,
``forward_kernels``) spends ~1.2 ms in RoPE's twelve half-width elementwise kernels (8 ``mul``, 2 ``sub_``, 2
``add_``). ``apply_rotary`` now takes three per tensor (one ``mul`` of ``x`` by a ``(seq, 2, rot)`` table of
``cos`` and signed ``sin`` writing all four products, one ``add`` per half), bit-identical; ``Lorsa.qk`` builds the
table once for q and k (the casts of cos/sin folded into its copies) and ``rotary_cos_sin`` no longer multiplies
its tables by an ``attention_scaling`` of 1.0. This counts, per forward, before -> after:

* ``profiler``: every ``aten::`` operator ``torch.profiler`` records on the CPU (calls by name, nested included);
* ``passes``: the operators that write data, as a ``TorchDispatchMode`` sees them below autograd (views and
  allocations aside; roughly the kernels a device runs), by name: calls and bytes written (numel × itemsize of
  their outputs, in place and ``out=`` included);
* the same ``passes`` at the Llama-3.1-8B / Lorsa-paper shape on the ``meta`` device (nothing computed;
  ``--meta-8b``; SDPA there is whatever meta dispatch gives, not the GPU's cuDNN kernel);
* CPU wall-time medians of the forward and of RoPE on the queries, before and after interleaved.

The "before" path is the former ``apply_rotary`` and ``rotary_cos_sin`` (frozen in this file, not in the
package) patched into ``nnsight_lorsa.modules.lorsa``; the outputs of both paths are compared bit for bit.

    python -m benchmarks.lorsa_forward_passes                    # 512 tokens, bf16 and fp32, + 8B on meta
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._timing import RESULTS, arg, command, environment, parser, start, time_interleaved, write_json
from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig
from nnsight_lorsa.modules import lorsa as lorsa_module
from nnsight_lorsa.modules.rotary import apply_rotary, rotary_cos_sin, rotary_inv_freq

LLAMA31_ROPE = dict(base=500000.0, rope_type="llama3", scaling=dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
SHAPES = {"small": dict(d_model=512, n_qk=32, d_qk=64, n_ov=4096, top_k=32),
          "8b": dict(d_model=4096, n_qk=256, d_qk=128, n_ov=32768, top_k=128)}


# ------------------------------------------------------------------ the former path (before), frozen here
def former_rotary_cos_sin(cfg: RotaryConfig, positions: torch.Tensor,
                          device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_cos_sin`` before: the tables always multiplied by ``attention_scaling``."""
    inv_freq = rotary_inv_freq(cfg, device=positions.device if device is None else device)
    freqs = positions[..., None].float() * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if cfg.interleaved else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * cfg.attention_scaling, emb.sin() * cfg.attention_scaling
    if cfg.table_dtype is not None:
        rounded = getattr(torch, cfg.table_dtype)
        cos, sin = cos.to(rounded).float(), sin.to(rounded).float()
    return cos, sin


def former_apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                        table: Any = None) -> torch.Tensor:
    """``apply_rotary`` before (``table`` ignored): three strided kernels on each half of every head."""
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    half = rot // 2
    if interleaved:
        x1, x2, c, s = x[..., 0:rot:2], x[..., 1:rot:2], cos[..., 0::2], sin[..., 0::2]
    else:
        x1, x2, c, s = x[..., :half], x[..., half:rot], cos[..., :half], sin[..., :half]
    out = torch.empty_like(x)
    first, second = (slice(0, rot, 2), slice(1, rot, 2)) if interleaved else (slice(0, half), slice(half, rot))
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        out[..., first] = x1 * c - x2 * s
        out[..., second] = x2 * c + x1 * s
    else:
        torch.mul(x1, c, out=out[..., first]).sub_(x2 * s)
        torch.mul(x2, c, out=out[..., second]).add_(x1 * s)
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out


@contextmanager
def path(name: str) -> Iterator[None]:
    """``"after"``: the package as it is; ``"before"``: the former RoPE and cos/sin patched into the Lorsa module
    (its ``qk`` then builds no table)."""
    if name == "after":
        yield
        return
    with mock.patch.object(lorsa_module, "apply_rotary", former_apply_rotary), \
            mock.patch.object(lorsa_module, "rotary_cos_sin", former_rotary_cos_sin), \
            mock.patch.object(lorsa_module, "rotary_table", lambda *a, **k: None):
        yield


# ------------------------------------------------------------------ counting
def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor view reaches (a broadcast, stride-0 dim counted once)."""
    return math.prod(n for n, st in zip(t.shape, t.stride(), strict=True) if st != 0) * t.element_size()


NOT_READ = ("copy_", "fill_", "zero_", "scatter_", "resize_")  # their first argument is only written


class Passes(TorchDispatchMode):
    """The operators that write data (views and ``empty*`` aside), below autograd: calls, bytes written (their
    outputs' numel × itemsize, in place and ``out=`` included) and bytes read (the distinct elements of their tensor
    arguments, ``out=`` aside: a lower bound, a matmul re-reads its operands). ``floor``: only the calls writing at
    least that many bytes."""

    def __init__(self, floor: int = 0) -> None:
        super().__init__()
        self.floor = floor
        self.calls: Counter[str] = Counter()
        self.written: Counter[str] = Counter()
        self.read: Counter[str] = Counter()

    def add(self, name: str, written: int, read: int) -> None:
        if written >= self.floor:
            self.calls[name] += 1
            self.written[name] += written
            self.read[name] += read

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name.startswith("empty") or name in ("_local_scalar_dense", "lift_fresh", "_unsafe_view"):
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = [a for a in (args[1:] if name in NOT_READ else args) if isinstance(a, torch.Tensor)]
        inputs += [v for k, v in kwargs.items() if k != "out" and isinstance(v, torch.Tensor)]
        self.add(name, sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor)),
                 sum(distinct_bytes(t) for t in inputs))
        return out

    def summary(self) -> dict[str, Any]:
        """Calls and bytes written and read, in all and by name."""
        return {"calls": sum(self.calls.values()), "bytes_written": sum(self.written.values()),
                "bytes_read": sum(self.read.values()),
                "by_name": {k: {"calls": self.calls[k], "bytes_written": self.written[k], "bytes_read": self.read[k]}
                            for k in sorted(self.calls)}}


def passes(fn: Callable[[], Any], floor: int | None = None) -> dict[str, Any]:
    """Passes of ``fn()``, SDPA counted as ONE op writing its output (as a fused device kernel does; on the CPU
    it runs the math path, whose bmm/softmax/casts would otherwise be counted, and on meta its decomposition)."""
    from torch.utils._python_dispatch import _disable_current_modes

    mode = Passes(floor or 0)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused(*args: Any, **kwargs: Any) -> torch.Tensor:
        with _disable_current_modes():
            out = sdpa(*args, **kwargs)
        reads = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        mode.add("scaled_dot_product_attention", out.numel() * out.element_size(),
                 sum(distinct_bytes(t) for t in reads))
        return out

    with torch.no_grad(), mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fused), mode:
        fn()
    return mode.summary()


def profiled(fn: Callable[[], Any]) -> dict[str, Any]:
    """``aten::`` operators by name as ``torch.profiler`` records them on the CPU (nested ones included)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = Counter(e.key for e in prof.key_averages() for _ in range(e.count) if e.key.startswith("aten::"))
    return {"aten_calls": sum(counts.values()), "by_name": dict(sorted(counts.items()))}


def build(shape: dict[str, int], dtype: torch.dtype, device: str, seed: int = 0) -> Lorsa:
    rot = RotaryConfig(head_dim=shape["d_qk"], rotary_dim=shape["d_qk"], **LLAMA31_ROPE)
    cfg = LorsaConfig(d_model=shape["d_model"], n_qk_heads=shape["n_qk"], d_qk_head=shape["d_qk"],
                      n_ov_heads=shape["n_ov"], top_k=shape["top_k"], rotary=rot)
    lorsa = Lorsa(cfg, device=device, dtype=dtype)
    if device != "meta":
        lorsa.reset_parameters(torch.Generator().manual_seed(seed))
        with torch.no_grad():  # non-zero biases (a trained Lorsa's), so that every term is exercised
            for p in (lorsa.b_Q, lorsa.b_K, lorsa.b_V, lorsa.b_D):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1)
    return lorsa.eval()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    a, b = a.masked_fill(nan, 0), b.masked_fill(b.isnan(), 0)
    return bool(torch.equal(nan, b.isnan() | nan) and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit()))


def one_setting(shape: dict[str, int], seq: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    lorsa = build(shape, dtype, "cpu")
    x = torch.randn(1, seq, shape["d_model"], generator=torch.Generator().manual_seed(1)).to(dtype)
    q_bytes = seq * shape["n_qk"] * shape["d_qk"] * x.element_size()
    res: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "seq": seq, "q_bytes": q_bytes}
    outs = {}
    for name in ("before", "after"):
        with path(name), torch.no_grad():
            outs[name] = lorsa(x, return_cache=True)
            res[name] = {"profiler": profiled(lambda: lorsa(x)), "passes": passes(lambda: lorsa(x)),
                         "passes_ge_half_q": passes(lambda: lorsa(x), q_bytes // 2)}
    (o_b, c_b), (o_a, c_a) = outs["before"], outs["after"]
    res["same_bits"] = {"out": same_bits(o_a, o_b), "z_pre": same_bits(c_a.z_pre, c_b.z_pre),
                        "z": same_bits(c_a.z, c_b.z), "topk_indices": bool(torch.equal(c_a.topk_indices,
                                                                                        c_b.topk_indices))}
    # CPU wall time, interleaved: the forward, and RoPE on the queries alone
    cfg = lorsa.cfg
    assert cfg.rotary is not None
    with torch.no_grad():
        q, _ = lorsa.qk(x)
        cos, sin = rotary_cos_sin(cfg.rotary, torch.arange(seq))

        def fwd(name: str) -> Callable[[], Any]:
            def run() -> None:
                with path(name):
                    lorsa(x)
            return run

        # each variant twice (``*_again``): the spread between two runs of the same code is the noise floor
        times = time_interleaved({"forward_before": fwd("before"), "forward_after": fwd("after"),
                                  "forward_before_again": fwd("before"), "forward_after_again": fwd("after"),
                                  "rope_q_before": lambda: former_apply_rotary(q, cos, sin),
                                  "rope_q_after": lambda: apply_rotary(q, cos, sin),
                                  "rope_q_before_again": lambda: former_apply_rotary(q, cos, sin),
                                  "rope_q_after_again": lambda: apply_rotary(q, cos, sin)}, repeats=repeats)
    res["cpu_median_ms"] = {k: round(v["median_s"] * 1e3, 3) for k, v in times.items()}
    res["cpu_min_ms"] = {k: round(v["min_s"] * 1e3, 3) for k, v in times.items()}
    return res


def meta_8b(seq: int) -> dict[str, Any]:
    """The op sequence at the 8B shape on ``meta`` (nothing allocated or computed), bf16."""
    shape = SHAPES["8b"]
    lorsa = build(shape, torch.bfloat16, "meta")
    x = torch.empty(1, seq, shape["d_model"], device="meta", dtype=torch.bfloat16)
    q_bytes = seq * shape["n_qk"] * shape["d_qk"] * 2
    out: dict[str, Any] = {"seq": seq, "q_bytes": q_bytes}
    for name in ("before", "after"):
        with path(name):
            out[name] = {"passes": passes(lambda: lorsa(x)), "passes_ge_half_q": passes(lambda: lorsa(x),
                                                                                         q_bytes // 2)}
    return out


def rope_bytes_moved(numel: int, itemsize: int) -> dict[str, Any]:
    """Elements read + written by RoPE on one q-sized tensor (tables aside, they stay in cache): the former form
    ``mul`` (read ½, write ½) + ``mul`` (½, ½) + ``sub_`` (1, ½) per half: 7·numel; the table form ``mul``
    (read 1, write 2) + ``add`` (1, ½) per half: 6·numel."""
    return {"before": 7 * numel * itemsize, "after": 6 * numel * itemsize}


def main() -> None:
    args = parser(__doc__, seq=512, repeats=15, shape=arg("small", choices=sorted(SHAPES)),
                  dtypes=arg(nargs="+", type=str, default=["bfloat16", "float32"]), meta_seq=2048,
                  no_meta=arg(False, action="store_true", help="skip the 8B shape on meta"),
                  out=arg(None, type=str)).parse_args()
    start(args, threads=1)
    shape = SHAPES[args.shape]
    result: dict[str, Any] = {"command": command("OMP_NUM_THREADS=1"), "shape": shape, "environment": environment(),
                              "settings": [one_setting(shape, args.seq, getattr(torch, d), args.repeats)
                                           for d in args.dtypes]}
    if not args.no_meta:
        result["meta_8b"] = meta_8b(args.meta_seq)
        numel = args.meta_seq * SHAPES["8b"]["n_qk"] * SHAPES["8b"]["d_qk"]
        moved = rope_bytes_moved(numel, 2)
        saved = 2 * (moved["before"] - moved["after"])  # q and k
        result["rope_8b_bf16"] = {"bytes_moved_per_tensor": moved, "bytes_saved_q_and_k": saved,
                                  "time_at_4TBps_ms": round(saved / 4e12 * 1e3, 4)}
    for s in result["settings"]:
        b, a = s["before"], s["after"]
        print(f"{s['dtype']:9s} seq {s['seq']}: aten ops {b['profiler']['aten_calls']} -> "
              f"{a['profiler']['aten_calls']}, writing ops {b['passes']['calls']} -> {a['passes']['calls']}, "
              f"written {b['passes']['bytes_written'] / 1e6:.2f} -> {a['passes']['bytes_written'] / 1e6:.2f} MB, "
              f"read {b['passes']['bytes_read'] / 1e6:.2f} -> {a['passes']['bytes_read'] / 1e6:.2f} MB, "
              f"ops writing >= q/2 {b['passes_ge_half_q']['calls']} -> {a['passes_ge_half_q']['calls']}, "
              f"same bits {all(s['same_bits'].values())}")
        print("   CPU medians (ms):", s["cpu_median_ms"])
        print("   CPU minima (ms):", s["cpu_min_ms"])
    if "meta_8b" in result:
        m = result["meta_8b"]
        for name in ("before", "after"):
            big = m[name]["passes_ge_half_q"]
            ops = ", ".join(f"{k} x{v['calls']}" for k, v in big["by_name"].items())
            print(f"8B meta {name}: ops writing >= q/2: {big['calls']} ({ops}), {big['bytes_written'] / 1e9:.3f} GB "
                  f"written, {big['bytes_read'] / 1e9:.3f} GB read")
        print("RoPE 8B bf16, q and k:", result["rope_8b_bf16"])
    result["median_note"] = "single-threaded CPU; GPU effect not measured"
    write_json(args.out or RESULTS / f"lorsa_forward_passes_{args.shape}.json", result)


if __name__ == "__main__":
    main()
