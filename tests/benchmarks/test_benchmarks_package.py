"""The benchmarks as a package (issue 22): run as ``python -m benchmarks.<name>``, no ``sys.path`` edits,
every result file cited by the docs and every cited result file present, and the reference code the
tests share with the benchmarks in one place."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT, tiny_tokenizer

RESULTS = ROOT / "benchmarks" / "results"


def _docs() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_every_result_file_is_cited_in_the_docs():
    text = _docs()
    uncited = [p.name for p in sorted(RESULTS.iterdir())
               if p.is_file() and not re.search(r"(?<![\w])" + re.escape(p.name), text)]
    assert not uncited, f"benchmarks/results files cited nowhere in README.md or docs/: {uncited}"


def test_every_cited_result_file_exists():
    """Concrete names only: ``results/gpu_*.json`` or ``results/gpu_scale_8b_<GPU name>.json`` name files a
    GPU session will write."""
    cited = set(re.findall(r"results/([\w.-]+\.json)", _docs()))
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert cited and not missing, f"cited but not in benchmarks/results: {missing}"


def test_no_benchmark_edits_sys_path():
    edits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "benchmarks").rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"sys\.path\s*(\.(insert|append|extend)\b|\+?=)", line)]
    assert not edits, edits


def test_benchmarks_import_nothing_from_tests():
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "benchmarks").rglob("*.py"))
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           if re.match(r"\s*(from|import) (tests|helpers|peer_reference|hostile_cases|loopback)\b", line)]
    assert not bad, bad


def test_the_shared_tokenizer_is_the_tests_tokenizer():
    """``tests/helpers.py`` keeps its own copy (the loopback server imports it with only ``tests/`` on its
    path); the benchmarks' copy must build the same tokenizer."""
    from benchmarks.reference.tokenizer import tiny_tokenizer as shared

    for vocab in (16, 128):
        ours, theirs = tiny_tokenizer(vocab), shared(vocab)
        assert ours.get_vocab() == theirs.get_vocab()
        assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.padding_side) == (
            theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.padding_side)
        assert ours("w2 w3 w9")["input_ids"] == theirs("w2 w3 w9")["input_ids"]


def test_benchmark_modules_import_as_a_package():
    import importlib

    for name in ("benchmarks._timing", "benchmarks.reference.attribution", "benchmarks.arithmetic_model"):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(ROOT / "benchmarks")
