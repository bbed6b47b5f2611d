"""The IOI / greater-than model's builder pieces (benchmarks/ioi_greater_than_model.py): tokenizer and data.

No training: every ``ioi_task`` / ``greater_than_task`` prompt must build with this tokenizer as the
tasks need it (single-token names and years, correct ≠ incorrect), and the training rows' answers
must be right.
"""

from __future__ import annotations

import importlib
import random

import pytest

from nnsight_lorsa.patching.tasks import (
    IOI_TEMPLATES,
    NAMES,
    NOUNS,
    greater_than_task,
    ioi_task,
    name_tokens,
    single_token,
)


@pytest.fixture(scope="module")
def igt():
    return importlib.import_module("benchmarks.ioi_greater_than_model")


@pytest.fixture(scope="module")
def tok(igt):
    return igt.build_tokenizer()


def test_names_and_years_are_single_tokens(igt, tok):
    ids = [single_token(tok, n) for n in NAMES]  # with the leading space, decoding back to it
    assert None not in ids and len(set(ids)) == len(NAMES) and tok.unk_token_id not in ids
    assert [n for n, _ in name_tokens(tok, NAMES, search_vocab=False)] == list(NAMES)
    assert single_token(tok, "Mary") is None  # no space-less twin: "Mary" is not " Mary"
    years = [single_token(tok, f"{y:02d}") for y in range(100)]
    assert None not in years and len(set(years)) == 100
    assert tok(" 1363", add_special_tokens=False)["input_ids"] == [single_token(tok, " 13"), years[63]]
    assert tok("Then, Mary")["input_ids"][0] == tok.bos_token_id


@pytest.mark.parametrize("template", IOI_TEMPLATES)
def test_ioi_task_builds(igt, tok, template):
    for names in (NAMES, igt.HELD_NAMES):
        task = ioi_task(tok, 16, template=template, names=names, seed=3)
        assert task.clean.shape == task.corrupt.shape and (task.clean[:, 0] == tok.bos_token_id).all()
        assert tok.unk_token_id not in task.clean and tok.unk_token_id not in task.corrupt
        for row, c, w, m in zip(task.clean.tolist(), task.correct_ids.tolist(), task.incorrect_ids.tolist(),
                                task.meta, strict=True):
            assert c != w and tok.decode([c]) == m["io"] and tok.decode([w]) == m["s"]
            assert row.count(c) == 1 and row.count(w) == 2  # IO once, S twice
            assert tok.decode(row[1:]) == m["text"]


def test_greater_than_task_uses_two_digit_answers(igt, tok):
    for noun in NOUNS:
        for century in igt.CENTURIES:
            task = greater_than_task(tok, 8, seed=century, century=century, noun=noun)
            assert tok.unk_token_id not in task.clean and tok.unk_token_id not in task.corrupt
            assert task.clean.shape == task.corrupt.shape == (8, 11)
            for m, c, w in zip(task.meta, task.correct_ids.tolist(), task.incorrect_ids.tolist(), strict=True):
                yy = igt.start_year(m["text"])
                assert m["text"].endswith(f" to {century}")  # the two-digit form, not the digit fallback
                assert (tok.decode([c]), tok.decode([w])) == (f"{yy + 1:02d}", f"{yy - 1:02d}")


def test_training_rows_have_right_answers(igt, tok):
    ids, mask, examples = igt.task_rows(tok, 400, random.Random(0))
    assert ids.shape[0] == 400 and int(mask.sum()) == 400 and (ids[:, 0] == tok.bos_token_id).all()
    assert tok.unk_token_id not in ids
    kinds = {"ioi": 0, "gt": 0}
    for row, mrow, (prompt, answer) in zip(ids.tolist(), mask.tolist(), examples, strict=True):
        t = mrow.index(True)
        assert tok.decode(row[1:t]) == prompt and tok.decode([row[t]]) == answer
        assert all(x == tok.eos_token_id for x in row[t + 1:])
        if prompt.startswith("The "):
            kinds["gt"] += 1
            yy, century = igt.start_year(prompt), int(prompt.split()[-1])
            assert int(answer) > yy and not (century == igt.HELD_CENTURY and yy in igt.HELD_YEARS)
        else:
            kinds["ioi"] += 1
            names = [n for n in NAMES if n.strip() in prompt.replace(",", " ").replace(".", " ").split()]
            assert len(names) == 2 and answer in names
            other = next(n for n in names if n != answer)
            words = prompt.replace(",", " ").replace(".", " ").split()
            assert words.count(answer.strip()) == 1 and words.count(other.strip()) == 2  # the IO is the one-off
            assert not (answer in igt.HELD_NAMES and other in igt.HELD_NAMES)
    assert kinds["ioi"] > 150 and kinds["gt"] > 150


def test_heldout_tasks_are_held_out(igt, tok):
    held = igt.heldout_tasks(tok, n_ioi=8, n_gt=8)
    assert len(held["ioi"]) == len(IOI_TEMPLATES) and len(held["greater_than"]) == len(NOUNS)
    for t in held["ioi"]:
        assert all(m["io"] in igt.HELD_NAMES and m["s"] in igt.HELD_NAMES for m in t.meta)
    for t in held["greater_than"]:
        assert 1 <= len(t) <= 8 and all(igt.start_year(m["text"]) in igt.HELD_YEARS for m in t.meta)
