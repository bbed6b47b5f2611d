"""Mutation probe, round 3 (docs/reliability.md): what the demo's size checks accept and what its pictures step
writes, where the earlier demo tests let a one-line change of ``demo.py`` through."""

from __future__ import annotations

import json
import re

from helpers import tiny_hf_model, tiny_tokenizer

from nnsight_lorsa.demo import DemoConfig, _check_sizes, run_demo


def test_top_k_equal_to_the_ov_heads_is_accepted():
    """``--top-k`` may be the number of OV heads (every head kept); one more is refused (mutant ``>=``)."""
    import pytest

    from nnsight_lorsa.errors import ArgumentError

    _check_sizes(DemoConfig(top_k=16), d_model=8, n_qk=4, d_qk=2, n_ov=16)
    with pytest.raises(ArgumentError, match="--top-k 17 exceeds the 16 OV heads"):
        _check_sizes(DemoConfig(top_k=17), d_model=8, n_qk=4, d_qk=2, n_ov=16)


def test_the_pictures_have_every_shown_heads_dashboard_and_the_graph_page_decodes_its_tokens(tmp_path):
    """A run with ``--n-show 3``: one dashboard per head the printout shows (mutant: only the first head's), the
    graph page's tokens are the tokenizer's (as ``graph.json``'s; mutant: ``tok<id>`` labels), and no shown
    context sits in positions 0-3 of its window (docs/training.md: ``demo.SKIP_START``)."""
    import nnsight_lorsa.demo as demo

    model_dir = tmp_path / "model"
    tiny_hf_model("llama").save_pretrained(model_dir)
    tok = tiny_tokenizer()
    tok.save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"w{i % 100 + 2}" for i in range(800)))
    out = tmp_path / "out"
    result = run_demo(DemoConfig(model_dir=str(model_dir), text_path=str(text), steps=2, seq_len=16, batch_size=4,
                                 heldout_windows=4, n_show=3, out_dir=str(out), progress=False))
    shown = {e["head"] for e in result["top_heads"]}
    layer = result["layer"]
    assert len(shown) >= 2  # not vacuous: several heads shown
    assert {p.name for p in (out / "dashboards").iterdir()} == {f"L{layer}_H{h}.html" for h in shown}
    assert demo.SKIP_START == 4 and all(e["position"] >= 4 for e in result["top_heads"])
    saved = json.loads((out / "graph.json").read_text())
    page = (out / "graph.html").read_text()
    drawn = json.loads(re.search(r"id='graph-data'>(.*?)</script>", page, re.S).group(1))
    want = [tok.decode([i]) for i in tok(demo.PROMPT)["input_ids"]]
    assert drawn["graph"]["metadata"]["prompt_tokens"] == saved["metadata"]["prompt_tokens"] == want
