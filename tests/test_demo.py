"""The main job (`nnsight-lorsa demo`) end to end, on a local model directory and a text file."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_hf_model, tiny_tokenizer

from nnsight_lorsa.cli import main


def test_demo_runs_on_a_local_model_dir_and_text_file(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_hf_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    words = [f"w{2 + (i * 7919) % 120}" for i in range(3000)]
    docs = [" ".join(words[i:i + 10 + i % 37]) for i in range(0, 3000, 50)]  # 60 documents, 10-46 words
    text.write_text(" <eos> ".join(docs))  # the tokenizer's EOS text separates them
    out = tmp_path / "out"
    code = main(["demo", "--model", str(model_dir), "--text", str(text), "--steps", "6", "--seq-len", "32",
                 "--batch-size", "4", "--heldout-windows", "8", "--n-show", "2", "--out-dir", str(out),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "corpus: 60 windows x 32 tokens (one per document, from its start)" in printed
    for needle in ("FVU", "L0", "dead heads", "CE orig", "CE lorsa", "CE zero-ablated", "lorsa.replace(layer=1)",
                   "z-pattern"):
        assert needle in printed
    result = json.loads((out / "demo_results.json").read_text())
    assert result["layer"] == 1 and result["config"]["n_ov_heads"] == 8 * 64
    assert result["eval"]["fvu"] >= 0 and result["eval"]["l0"] <= 16
    assert (out / "lorsa" / "layer_1" / "model.safetensors").is_file()


def test_demo_rejects_a_layer_out_of_range(tmp_path):
    from nnsight_lorsa.errors import LayerOutOfRangeError

    model_dir = tmp_path / "model"
    tiny_hf_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"w{i % 100 + 2}" for i in range(500)))  # one document: consecutive windows
    with pytest.raises(LayerOutOfRangeError):
        main(["demo", "--model", str(model_dir), "--text", str(text), "--layer", "9", "--no-progress"])
