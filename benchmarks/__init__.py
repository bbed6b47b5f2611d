"""The benchmarks: each ``benchmarks/<name>.py`` is a script run from the repository root as a module,
``python -m benchmarks.<name> [--options]`` (``--help`` lists them); each writes
``benchmarks/results/<name>.json`` (or ``--out``), cited in ``docs/benchmarks.md`` and the other docs.

Shared code: :mod:`._timing` (options, start-up, timing, JSON output), :mod:`._synthetic` and
:mod:`._tiny_models` (the small trained models), :mod:`.reference` (the reference engine and tokenizer the
tests use too). No script edits ``sys.path``.
"""
