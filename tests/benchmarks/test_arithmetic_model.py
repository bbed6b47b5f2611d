"""The arithmetic model's builder pieces (benchmarks/arithmetic_model.py): tokenizer and data; no training."""

from __future__ import annotations

import importlib

import pytest
import torch

from nnsight_lorsa.patching.tasks import arithmetic_grid, arithmetic_task


@pytest.fixture(scope="module")
def am():
    return importlib.import_module("benchmarks.arithmetic_model")  # it imports the shared benchmarks._synthetic


@pytest.fixture(scope="module")
def tok(am):
    return am.build_tokenizer()


def test_every_number_is_one_token(am, tok):
    ids = [tok(str(n), add_special_tokens=False)["input_ids"] for n in range(am.MAX_NUMBER + 1)]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == am.MAX_NUMBER + 1
    assert tok.unk_token_id not in {i[0] for i in ids}
    assert [am.number_id(n) for n in range(am.MAX_NUMBER + 1)] == [i[0] for i in ids]
    assert tok.decode(tok("12 + 34 = 46", add_special_tokens=False)["input_ids"]) == "12 + 34 = 46"
    assert tok("7 + 8 =")["input_ids"][0] == tok.bos_token_id


def test_arithmetic_task_prompts(am, tok):
    # sums up to 188: the task's wrong answer (sum + 10) is then a number token too
    pairs = [(a, b) for a in (0, 9, 10, 55, 89) for b in (0, 1, 50, 99)]
    task = arithmetic_task(tok, pairs)
    num0 = am.number_id(0)
    plus, eq = tok.convert_tokens_to_ids(["+", "="])
    for row, (a, b), c, w in zip(task.clean.tolist(), pairs, task.correct_ids.tolist(),
                                 task.incorrect_ids.tolist(), strict=True):
        assert row == [tok.bos_token_id, num0 + a, plus, num0 + b, eq]  # each operand one token, BOS first
        assert c == num0 + a + b  # the whole answer is the first answer token
        assert w != c and num0 <= w <= num0 + am.MAX_NUMBER
    assert task.corrupt.shape == task.clean.shape
    # above 188 ``sum + 10`` has no token: the builder skips the <unk> fallback for the next wrong sum
    wrong = int(arithmetic_task(tok, [(99, 99)]).incorrect_ids[0])
    assert wrong != tok.unk_token_id and tok.decode([wrong]).strip() == "197"
    assert (task.corrupt[:, 3] != task.clean[:, 3]).all()


def test_arithmetic_grid_is_one_group(am, tok):
    grid = arithmetic_grid(tok)
    assert len(grid.groups) == 1
    ids, a, b = grid.groups[0]
    assert ids.shape == (10_000, 5)
    assert torch.equal(ids[:, 1], a + am.number_id(0)) and torch.equal(ids[:, 3], b + am.number_id(0))
    g = grid.assemble([a + 1000 * b])
    assert g[12, 34] == 12 + 34_000


def test_equation_rows_have_correct_sums(am, tok):
    train, held = am.split_pairs()
    assert len(train) + len(held) == 10_000 and not set(train) & set(held)
    pairs = torch.tensor(held)
    ids, mask = am.equation_rows(pairs, 64, torch.Generator().manual_seed(0))
    assert ids.shape == (64, 1 + 6 * am.EQS_PER_ROW) and (ids[:, 0] == tok.bos_token_id).all()
    assert int(mask.sum()) == 64 * am.EQS_PER_ROW
    heldset = set(held)
    for row in ids.tolist():
        text = tok.decode(row[1:])
        eqs = [e.split() for e in text.split(";") if e.strip()]
        assert len(eqs) == am.EQS_PER_ROW
        for a, plus, b, eq, c in eqs:
            assert (plus, eq) == ("+", "=") and int(a) + int(b) == int(c)
            assert (int(a), int(b)) in heldset
    # the mask marks exactly the answers
    assert torch.equal(ids[:, 5::6], ids[mask].view(64, -1))
