"""Mutation probe, round 11 (docs/reliability.md): the demo's checks before any work — the memory bound, which
directories of an ``--out-dir`` are the demo's own, and what a checkpoint records for ``--resume`` to check. Each
test was seen failing with a one-line mutant of ``demo.py`` that the default tests let through; the references are
the functions' documented rules (their docstrings), written out here by hand."""

from __future__ import annotations

import pytest

import nnsight_lorsa.demo as demo
from nnsight_lorsa.errors import ArgumentError


def test_the_training_memory_bound_is_the_documented_count_of_fp32_numbers():
    """``_training_bytes``: fp32 (4 bytes) × [4 copies (weights, gradients, Adam's two moments) of
    ``2·n_qk·d_qk·d_model + 2·n_ov·d_model`` parameters + ``3·batch·seq·n_ov`` activations + ``batch·n_qk·seq²`` QK
    pattern entries] — sizes drawn so that every term moves the total."""
    d_model, n_qk, d_qk, n_ov, batch, seq = 48, 6, 8, 384, 3, 20
    params = 2 * n_qk * d_qk * d_model + 2 * n_ov * d_model
    want = 4 * (4 * params + 3 * batch * seq * n_ov + batch * n_qk * seq * seq)
    assert demo._training_bytes(d_model, n_qk, d_qk, n_ov, batch, seq) == want
    # doubling the window quadruples the pattern term exactly
    grown = demo._training_bytes(d_model, n_qk, d_qk, n_ov, batch, 2 * seq) - demo._training_bytes(
        d_model, n_qk, d_qk, n_ov, batch, seq)
    assert grown == 4 * (3 * batch * seq * n_ov + 3 * batch * n_qk * seq * seq)


def test_a_lorsa_folder_with_a_file_of_the_users_is_not_the_demos_and_survives_overwrite(tmp_path):
    """``_ours``: ``lorsa/`` is the demo's only if it holds nothing but ``layer_*`` folders (and the set index); one
    with a ``layer_0`` beside a user's notes is not — refused, also under ``--overwrite``, and nothing deleted."""
    out = tmp_path / "out"
    (out / "lorsa" / "layer_0").mkdir(parents=True)
    (out / "lorsa" / "notes.txt").write_text("mine")
    assert demo._ours(out / "lorsa") is False
    with pytest.raises(ArgumentError, match="not the demo's output"):
        demo._check_earlier_outputs(demo.DemoConfig(out_dir=str(out), overwrite=True))
    assert (out / "lorsa" / "notes.txt").read_text() == "mine" and (out / "lorsa" / "layer_0").is_dir()


def test_the_run_info_a_resume_checks_records_the_batch_seq_seed_dtype_and_the_datas_hash():
    """``_run_info``: "the batch size, window length, seed and model dtype, and the sha256 of the training windows'
    token ids (and target mask)" — each recorded as given (a resume with another ``--dtype`` is refused only if it is
    there), the hash ``hashlib.sha256`` of the int64 ids then the bool mask."""
    import hashlib

    import torch

    from nnsight_lorsa.training import TokenDataset

    tokens = torch.arange(12).reshape(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    cfg = demo.DemoConfig(batch_size=3, seq_len=4, seed=11, dtype="bfloat16")
    info = demo._run_info(cfg, TokenDataset(tokens, mask))
    want = hashlib.sha256(tokens.numpy().astype("int64").tobytes())
    want.update(mask.numpy().tobytes())
    assert info == {"batch_size": 3, "seq_len": 4, "seed": 11, "dtype": "bfloat16", "data_sha256": want.hexdigest()}
