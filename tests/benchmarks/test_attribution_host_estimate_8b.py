"""``benchmarks/attribution_host_estimate_8b`` runs end to end on a short synthetic prompt (no model): its layout
goes through ``estimate_layout`` (offload terms included) and the JSON it writes holds the estimate's terms."""

from __future__ import annotations

import json
import sys

from benchmarks import attribution_host_estimate_8b as bench


def test_host_estimate_8b_writes_its_terms(tmp_path, monkeypatch):
    out = tmp_path / "estimate"
    monkeypatch.setattr(sys, "argv", ["bench", "--tokens", "16", "32", "--rows", "8", "--name", str(out)])
    bench.main()
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert [r["tokens"] for r in runs] == [16, 32]
    for r in runs:
        assert r["target_rows"] == 8 + bench.SHAPE["n_logits"]
        assert 0 < r["rows_blocks_bytes"] < r["host_bytes"] and r["device_bytes"] > 0
    # the frozen pass grows with the prompt
    assert runs[1]["device_bytes"] > runs[0]["device_bytes"]
