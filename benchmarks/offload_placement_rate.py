"""How fast offloading moves a module to pinned host memory (``_placement.store_on_host``), per host-allocator setting.

On an H200 on 2026-11-26 (`benchmarks/results/gpu_scale_8b_NVIDIA_H200.json`, the offloaded (d) run) building and
offloading the paper's 32 Lorsas (1.07 GB each) took 145 s and 32 TopK transcoders (0.54 GB each) 53 s: ~0.3 GB/s,
where a device-to-host copy runs at tens of GB/s. ``store_on_host`` allocates each tensor with
``torch.empty(..., pin_memory=True)`` (CUDA's caching host allocator: ``cudaHostAlloc``, which page-locks the whole
block) and copies into it. This times that move for ``--modules`` modules of ``--mb`` MB each (bf16 tensors made on
the GPU), once with the default allocator and once per ``PYTORCH_CUDA_ALLOC_CONF`` setting in ``--confs`` (each in
its own process: the setting is read at the first pinned allocation), e.g. torch's
``pinned_use_cuda_host_register:True,pinned_num_register_threads:8`` (malloc, pages touched by 8 threads, then
``cudaHostRegister``). Writes GB/s per setting; needs CUDA (on a CPU machine it writes ``{"skipped": ...}``).

    python -m benchmarks.offload_placement_rate                       # on a CUDA machine
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks._timing import RESULTS, arg, parser, write_json

DEFAULT_CONFS = ["", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"]


def one(modules: int, mb: int) -> dict[str, Any]:
    """In this process: ``modules`` modules of two ``mb / 2`` MB bf16 parameters each, built on the GPU and moved
    to pinned host memory by ``store_on_host``; seconds and GB/s of the moves."""
    from nnsight_lorsa._placement import store_on_host

    n = mb * 2**20 // 2 // 2  # bf16 numbers per parameter
    seconds = []
    for i in range(modules):
        m = torch.nn.Module()
        m.a = torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16))
        m.b = torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        store_on_host(m, f"module {i}")
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        assert m.a.is_pinned() and m.b.is_pinned()
    total = sum(seconds)
    return {"modules": modules, "mb_each": mb, "seconds": total, "first_s": seconds[0],
            "gb_per_s": modules * mb / 1024 / total}


def main() -> None:
    args = parser(__doc__, modules=8, mb=512, confs=arg(DEFAULT_CONFS, nargs="*", type=str), child=False,
                  out=arg(None, type=str)).parse_args()
    if args.child:
        print(json.dumps(one(args.modules, args.mb)))
        return
    out: dict[str, Any] = {"torch": torch.__version__}
    if not torch.cuda.is_available():
        out["skipped"] = "no CUDA device"
    else:
        out["device"] = torch.cuda.get_device_name(0)
        out["runs"] = {}
        for conf in args.confs:
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf} if conf else os.environ.copy()
            if not conf:
                env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            done = subprocess.run([sys.executable, "-m", "benchmarks.offload_placement_rate", "--child",
                                   "--modules", str(args.modules), "--mb", str(args.mb)],
                                  env=env, capture_output=True, text=True, timeout=600)
            lines = done.stdout.strip().splitlines()
            out["runs"][conf or "default"] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "error": done.stderr[-500:]}
            print(conf or "default", out["runs"][conf or "default"])
    safe = "".join(c if c.isalnum() else "_" for c in out.get("device", "cpu"))
    write_json(args.out or RESULTS / f"offload_placement_rate_{safe}.json", out)


if __name__ == "__main__":
    main()
