"""Docs versus code (docs/reliability.md, "Docs versus code probe (2026-11-28)"): every keyword a call in
README.md or docs/*.md passes — ``name(kw=…)`` or ``obj.name(kw=…)`` on one line, in prose or code — is a real
parameter of the public callable of that name (a name in the ``__all__`` of ``nnsight_lorsa`` or of a
subpackage, or a method of such a class), so a researcher who copies it gets no ``TypeError``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import nnsight_lorsa

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CALL = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\(")
KEYWORD = re.compile(r"(?:^|,)\s*([a-z_]\w*)\s*=(?!=)")


def _public() -> tuple[dict, dict]:
    modules = [nnsight_lorsa, *(getattr(nnsight_lorsa, n) for n in dir(nnsight_lorsa)
                                if inspect.ismodule(getattr(nnsight_lorsa, n, None)))]
    functions: dict = {}
    for module in modules:
        if module.__name__.startswith("nnsight_lorsa"):
            for name in getattr(module, "__all__", ()):
                if (obj := getattr(module, name, None)) is not None:
                    functions.setdefault(name, obj)
    methods: dict = {}
    for obj in functions.values():
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if callable(value) or isinstance(value, (classmethod, staticmethod)):
                    methods.setdefault(attr, []).append(getattr(obj, attr))
    return functions, methods


def _parameters(obj) -> set[str] | None:
    """The keywords ``obj`` accepts; ``None`` where it takes any (``**kwargs``) or has no signature."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return set(signature.parameters)


def _calls(line: str):
    """``(name, top-level keywords)`` of every call on ``line`` that closes on it, nested ones included."""
    for match in CALL.finditer(line):
        depth, end = 0, match.end()
        while end < len(line) and not (line[end] == ")" and depth == 0):
            depth += {"(": 1, ")": -1}.get(line[end], 0)
            end += 1
        if end == len(line):
            continue  # the call goes on on the next line: not checked
        flat = line[match.end():end]
        while (shorter := re.sub(r"\([^()]*\)|\{[^{}]*\}|\[[^\[\]]*\]", "", flat)) != flat:
            flat = shorter
        yield match.group(1), set(KEYWORD.findall(flat))


def test_every_keyword_a_doc_passes_is_a_parameter():
    functions, methods = _public()
    bad = []
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for dotted, keywords in _calls(line):
                name = dotted.split(".")[-1]
                builtin = any(hasattr(kind, name) for kind in (dict, list, set, str, tuple))  # seen.update(x=…)
                candidates = [functions[name]] if name in functions else (
                    methods.get(name, []) if "." in dotted and not builtin else [])
                if not keywords or not candidates:
                    continue
                accepted = [_parameters(c) for c in candidates]
                if not any(a is None or keywords <= a for a in accepted):
                    known = set().union(*(a for a in accepted if a is not None))
                    bad.append(f"{path.name}:{number}: {dotted}(…) has no {sorted(keywords - known)}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_wrong_keyword():
    assert ("attribute", {"memory", "no_such_keyword"}) in list(_calls("`attribute(model, memory='lean', "
                                                                        "no_such_keyword=1)`"))
