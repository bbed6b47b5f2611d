"""``benchmarks/gpu_scale.py`` (the 8B-shape GPU benchmark of issue 21) runs end to end at its tiny scale on
the CPU, so that the script a GPU session runs is known to work before that session spends device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT


def test_gpu_scale_runs_at_the_tiny_scale_on_cpu(tmp_path):
    out = tmp_path / "gpu_scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_scale", "--scale", "tiny", "--device",
                           "cpu", "--dtype", "float32", "--tokens", "16", "--repeats", "1", "--train-steps", "1",
                           "--profile-kernels", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["scale"] == "tiny"
    assert result["a_forward_vs_floor"]["ratio"] > 0 and result["b_replace_vs_trace"]["ratio"] > 0
    assert result["b_replace_vs_trace"]["mhsa_skipped_same_logits"]  # skipping the discarded MHSA changes nothing
    assert result["c_training"]["tokens_per_s_with_model"] > 0
    (row,) = result["d_attribution"]
    assert row["tokens"] == 16 and row["target_rows"] > 0 and row["estimate_device_bytes"] > 0
    assert row["edge_sum_error_max"] < 1e-5  # fp32: every row sums to its value (feature budget included)
    # --profile-kernels: one more call's top operators by host time (no device kernels on the CPU)
    profile = row["kernel_profile"]
    assert profile["device"] == [] and 0 < len(profile["cpu"]) <= 5
    assert all(r["cpu_ms"] >= 0 and r["calls"] > 0 for r in profile["cpu"])


def test_gpu_scale_attribution_offloaded_at_the_tiny_scale_on_cpu(tmp_path):
    """Part (d) with ``--offload`` (the Lorsas and transcoders offloaded to the host) runs and records it."""
    out = tmp_path / "gpu_scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_scale", "--scale", "tiny", "--device", "cpu",
                           "--dtype", "float32", "--tokens", "16", "--repeats", "1", "--skip", "a", "b", "c",
                           "--offload", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["d_offload"] is True and result["d_module_bytes"] > 0
    (row,) = result["d_attribution"]
    assert row["tokens"] == 16 and row["target_rows"] > 0 and row["edge_sum_error_max"] < 1e-5
    # the device peak per phase and the snapshot at the peak are CUDA's (None on the CPU), their keys always there
    assert row["phase_peaks"] is None and row["memory_snapshot"] is None and result["d_memory_snapshot"] is False


def test_gpu_scale_trains_a_bf16_lorsa_through_masters_at_the_tiny_scale_on_cpu(tmp_path):
    """Part (c) with a bf16 model also trains a bf16 Lorsa (fp32 master weights) and records its throughput."""
    out = tmp_path / "gpu_scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_scale", "--scale", "tiny", "--device", "cpu",
                           "--dtype", "bfloat16", "--repeats", "1", "--train-steps", "1", "--skip", "a", "b", "d",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["c_training"]["tokens_per_s_bare_step"] > 0
    assert result["c_training_bfloat16_masters"]["tokens_per_s_bare_step"] > 0
