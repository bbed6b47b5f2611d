"""Reference code shared by the tests and the benchmarks, in one importable place.

* :mod:`.attribution` — the PyTorch-hook attribution engine the nnsight engine is tested
  (``tests/attribution/test_attribution.py``) and benchmarked (``benchmarks/bench_attribution.py``) against;
* :mod:`.tokenizer` — the tiny word-level tokenizer of the tests' tiny models.

The tests import it as ``benchmarks.reference.…`` (the repository root is on their path through
pytest's ``pythonpath`` option); the benchmarks run as modules from the root (``python -m benchmarks.<name>``).
"""
