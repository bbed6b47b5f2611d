"""docs/training.md's table of ``TrainConfig`` defaults and the code agree: every field with a default is in the
table, with the code's value, and the table names no field the code lacks. A default changed in one place only
fails here, so the documented value is the independent statement a test of the default can pin."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from nnsight_lorsa import TrainConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
HEADING = "## `TrainConfig`'s defaults and where they come from"


def _table() -> dict[str, str]:
    text = DOC.read_text(encoding="utf-8")
    assert HEADING in text, f"{DOC} lost its section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`(\w+)`\s*\|\s*`([^`]+)`", line)
        if m:
            assert m.group(1) not in rows, f"field {m.group(1)} twice in the table"
            rows[m.group(1)] = m.group(2)
    return rows


def _value(text: str) -> object:
    """A table cell's default: a Python literal, or ``a/b`` for a fraction."""
    frac = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if frac:
        return int(frac.group(1)) / int(frac.group(2))
    return ast.literal_eval(text)


def _defaults() -> dict[str, object]:
    out: dict[str, object] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def test_the_table_lists_every_default_field_and_no_other() -> None:
    assert set(_table()) == set(_defaults())


@pytest.mark.parametrize("name", sorted(_defaults()))
def test_each_documented_default_is_the_code_default(name: str) -> None:
    documented = _value(_table()[name])
    actual = _defaults()[name]
    if isinstance(actual, float):
        assert isinstance(documented, (int, float)) and documented == pytest.approx(actual, rel=0, abs=0)
    else:
        assert documented == actual and type(documented) is type(actual), (name, documented, actual)


def test_the_default_config_carries_the_table_values() -> None:
    """A constructed config (what a researcher gets) has the documented values, not only the dataclass fields."""
    cfg = TrainConfig(total_steps=10)
    for name, text in _table().items():
        assert getattr(cfg, name) == _value(text), name
