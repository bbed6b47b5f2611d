"""``benchmarks/attribution_traffic.py``: its byte rules on single operators, and a run at the tiny scale whose
counts are consistent (the floor's forward reads every weight at least once; each stage's roofline is at least its
bytes over the bandwidth)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from helpers import ROOT


def _counted(fn):
    from benchmarks.attribution_traffic import Traffic

    mode = Traffic()
    with mode, mode.counting("s"):
        fn()
    return {op: (c, b, f) for (_, op, _), (c, b, f, _) in mode.rows.items()}


def test_byte_rules_of_single_operators():
    a = torch.randn(64, 32)
    idx = torch.tensor([3, 5, 7])
    rows = _counted(lambda: (a[idx], a.view(32, 64), a.t(), a + 1, a.add_(1), a @ a.T,
                             torch.zeros(64, 32).index_copy_(0, idx, torch.ones(3, 32))))
    assert rows["index"][1] == 2 * 3 * 32 * 4 + 3 * 8  # the rows gathered, read and written, and the indices
    assert rows["view"][1] == rows["t"][1] == 0  # views move nothing
    assert rows["add"][1] == 2 * 64 * 32 * 4  # read and written
    assert rows["add_"][1] == 64 * 32 * 4  # in place: self once
    assert rows["mm"][2] == 2 * 64 * 32 * 64  # FLOPs from torch's registry
    assert rows["index_copy_"][1] == 2 * 3 * 32 * 4 + 3 * 8  # the rows written, not the whole destination


def test_tiny_run_counts_are_consistent(tmp_path):
    out = tmp_path / "traffic.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.attribution_traffic", "--scale", "tiny", "--tokens", "16",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    s = result["shapes"]
    d, hd = s["d_model"], s["d_model"] // s["n_heads"]
    # every weight of the floor's layers is read at least once by its forward (fp32 at the tiny scale's bfloat16: 2 B)
    layer_weights = s["n_layers"] * (d * (d + 2 * s["n_kv"] * hd + d) + 3 * d * s["d_mlp"]) * 2
    (run,) = result["runs"]
    assert run["batches"] >= 1 and run["target_rows"] >= 1
    assert run["floor"]["bytes"] >= layer_weights
    for part in ("floor", "per_batch", "frozen_forward"):
        for name, dev in result["devices"].items():
            assert run[part]["roofline_s"][name] >= run[part]["bytes"] / dev["bandwidth"] * (1 - 1e-9) > 0
        assert run[part]["top"] and all(r["frame"] for r in run[part]["top"])
    # the frozen pass's operators are attributed to the package's frames
    assert any(r["frame"] != "-" for r in run["per_batch"]["top"])


def test_gathered_kernels_counts_a_small_site(tmp_path):
    """``benchmarks/gathered_kernels.py`` at a small site: per pass of its one chunk, the rows' gather and the product
    (and the bf16 write's cast), forward and backward, nothing else dispatched."""
    from benchmarks.gathered_kernels import count

    row = count(8, 4, 16, 32, 3, torch.bfloat16)
    assert row["chunks_per_pass"] == 1
    for name in ("write", "read"):
        ops = row[name]["by_operator"]
        assert ops["index"] == 2 and ops["bmm"] == 2, ops
        assert row[name]["bytes"] > 0
