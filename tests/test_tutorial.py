"""The tutorial (``examples/tutorial.py``, docs/tutorial.md) runs end to end on the embedded model with small
settings — replace -> patch -> attribute -> dashboard — and writes what it says it writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "examples" / "tutorial.py"


def test_the_tutorial_runs_and_writes_its_pages(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(TUTORIAL), "--out", str(out), "--windows", "8", "--seq-len", "32"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert "logits equal the model's: True" in text, text
    head = int(re.search(r"ablating head (\d+) moves it most", text).group(1))
    assert re.search(r"replacement score 0\.\d\d, completeness 0\.\d\d", text), text
    assert sorted(p.name for p in out.iterdir()) == ["graph.html", "graph.json", f"head_{head}.html"]
    graph = json.loads((out / "graph.json").read_text())
    assert {n["feature_type"] for n in graph["nodes"]} >= {"lorsa", "embedding", "logit"}
    assert graph["metadata"]["prompt"] == "ROMEO:\nBut soft, what light"
    assert "graph-data" in (out / "graph.html").read_text()
    assert "head-data" in (out / f"head_{head}.html").read_text()
