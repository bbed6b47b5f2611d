"""``benchmarks/attribution_flops.py`` runs at the tiny scale (a few seconds) and its analytic FLOP counts are the
counted ones exactly: the floor, each stage of ``attribute`` and every batch's backward (so the formulas that
extrapolate to the Llama-3.1-8B shape describe what the code computes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT


def test_attribution_flops_counts_agree_with_the_formulas_at_the_tiny_scale(tmp_path):
    out = tmp_path / "flops.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.attribution_flops", "--scale", "tiny", "--tokens", "8",
                           "16", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("one_layer", "all_layers"):
        for row in result[name]:
            assert row["floor_flops"] == row["floor_flops_analytic"] > 0
            assert row["flops"]["clean_pass_and_layout"] == row["analytic"]["clean_pass_and_layout"]
            assert row["flops"]["frozen_forward"] == row["analytic"]["frozen_forward"]
            assert row["backward_flops_per_batch"] == row["backward_flops_per_batch_analytic"]
            assert row["edge_sum_error_max"] < 1e-4
    for rows in result["extrapolated_8b"].values():
        assert [r["tokens"] for r in rows] == [512, 1024, 2048, 4096]
        assert all(0 < r["minimum_asymptote_stored"] <= r["asymptote"] <= r["call"] for r in rows)
