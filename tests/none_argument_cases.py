"""Every public callable of the package (the subpackages' ``__all__``) called with the same wrong value — None, a
str, an empty list, NaN — for each required argument, in a plain interpreter (without the suite's beartype hook, as a
researcher's process runs) inside an empty scratch directory: ``python tests/none_argument_cases.py --json OUT``
writes one record per callable and value, ``{"name", "value", "kind", "error", "ours", "message"}`` (``kind``:
``record`` for a dataclass that holds what it is given, else ``entry``; ``error``: the exception's class name, None
when the call returned; ``ours``: whether it is a ``LorsaError``). Read by ``tests/test_none_arguments.py``."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

warnings.simplefilter("ignore")

from nnsight_lorsa.errors import LorsaError  # noqa: E402

SUBPACKAGES = ("", ".training", ".analysis", ".patching", ".attribution", ".formats", ".modules", ".envoy", ".remote",
               ".ndif_rules", ".demo",
               ".sparse_attention", ".adapters", ".viz")


def public_callables() -> dict[str, object]:
    """``{qualified name: callable}``, each object once (under the first subpackage that exports it)."""
    out: dict[str, object] = {}
    seen: set[int] = set()
    for sub in SUBPACKAGES:
        mod = importlib.import_module("nnsight_lorsa" + sub)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if callable(obj) and id(obj) not in seen and not (isinstance(obj, type) and issubclass(obj, BaseException)):
                seen.add(id(obj))
                out[f"nnsight_lorsa{sub}.{name}"] = obj
    return out


#: the wrong values, each given to every required argument at once (a str is read as a relative path where one is
#: taken: the probe runs in an empty scratch directory)
VALUES: dict[str, object] = {"None": None, "'x'": "x", "[]": [], "nan": float("nan")}


def record(name: str, obj: object, label: str, value: object) -> dict | None:
    fn = obj if isinstance(obj, type) else inspect.unwrap(obj)  # type: ignore[arg-type]
    try:
        params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required:
        return None
    args = [value for p in required if p.kind != p.KEYWORD_ONLY]
    kwargs = {p.name: value for p in required if p.kind == p.KEYWORD_ONLY}
    kind = "record" if dataclasses.is_dataclass(obj) and not name.endswith("Config") else "entry"
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
        error, ours, message = None, False, ""
    except Exception as e:  # noqa: BLE001 — recorded for the test
        error, ours, message = type(e).__name__, isinstance(e, LorsaError), str(e)[:300]
    return {"name": name, "value": label, "kind": kind, "error": error, "ours": ours, "message": message}


def main(out_path: str) -> None:
    out = Path(out_path).resolve()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        records = [r for name, obj in public_callables().items() for label, value in VALUES.items()
                   if (r := record(name, obj, label, value)) is not None]
        written = sorted(os.listdir(scratch))
    out.write_text(json.dumps({"records": records, "written": written}, indent=1))


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--json") + 1])
