"""Weights & Biases logging of a training run (issue 25): ``TrainConfig(wandb_project=...)`` logs every history
entry as ``train/<name>`` and ``Trainer.log_evaluation`` as ``eval/<name>`` (evaluate's metric names), checked on
the records of an offline run (``WANDB_MODE=offline``, a temporary ``WANDB_DIR``: no network); without wandb
installed, asking for it is a named error before any step."""

from __future__ import annotations

import builtins
import inspect
import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from nnsight_lorsa.errors import ArgumentError, MissingDependencyError
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch
from nnsight_lorsa.training.evaluate import Evaluation

D = 8


def source(i: int) -> Batch:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(4, 6, D, generator=g)
    return Batch(x=x, y=x, loss_mask=torch.ones(4, 6, dtype=torch.bool))


def sae() -> SparseAutoencoder:
    torch.manual_seed(0)
    return SparseAutoencoder(SAEConfig(d_in=D, d_sae=16, activation="topk", activation_params={"k": 2}))


def offline_records(run_file: Path) -> list:
    """The records of a ``run-<id>.wandb`` file: W&B's header (``:W&B`` + magic + version, 7 bytes), then
    LevelDB-log chunks in 32 KiB blocks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last), each
    record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def logged(wandb_dir: Path, run_file: Path | None = None) -> tuple[list[dict[str, float]], dict]:
    """(history rows, run config) of ``run_file``, default the one offline run under ``wandb_dir``."""
    runs = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")) if run_file is None else [run_file]
    assert len(runs) == 1, runs
    deadline = time.monotonic() + 60
    records = offline_records(runs[0])
    # run.finish() returns before wandb's service process has flushed an offline run's file: wait for its end
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = offline_records(runs[0])
    rows, config = [], {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    return rows, config


@pytest.fixture
def offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # wandb keeps its settings (WANDB_DIR …) in a process-wide singleton: start from the env below
    for name in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    yield tmp_path
    wandb.teardown()


def test_training_and_evaluation_metrics_reach_the_offline_run(offline):
    trainer = Trainer(sae(), source, TrainConfig(total_steps=6, log_every=2, wandb_project="nnsight-lorsa-test",
                                                 wandb_run_name="sae-test"))
    history = trainer.train(progress=False)
    ev = Evaluation(fvu=0.25, l0=2.0, dead_frac=0.125, ce_orig=3.0, ce_spliced=3.5, ce_zero=5.0, kl=0.4,
                    n_tokens=96, l2_norm_in=1.0, l2_norm_out=0.9, l2_ratio=0.9,
                    relative_reconstruction_bias=0.95, feature_density=[0.1] * 16)
    flat = trainer.log_evaluation(ev)
    run_id = trainer.wandb_run_id
    trainer.close_logging()
    assert isinstance(run_id, str) and run_id

    rows, config = logged(offline)
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["_step"] for r in train_rows] == [2, 4, 6] == [h["step"] for h in history]
    for row, entry in zip(train_rows, history, strict=True):
        for name in ("loss", "fvu", "l0", "dead_frac", "lr"):
            assert row[f"train/{name}"] == pytest.approx(entry[name]), name
    eval_row = next(r for r in rows if "eval/fvu" in r)
    assert eval_row["_step"] == 6
    expected = {"eval/fvu": 0.25, "eval/l0": 2.0, "eval/dead_frac": 0.125, "eval/ce_orig": 3.0,
                "eval/ce_spliced": 3.5, "eval/ce_zero": 5.0, "eval/ce_recovered": 0.75, "eval/kl": 0.4,
                "eval/n_tokens": 96.0, "eval/l2_ratio": 0.9}
    for name, value in expected.items():
        assert eval_row[name] == pytest.approx(value), name
        assert flat[name] == pytest.approx(value), name
    assert not any("feature_density" in k for k in eval_row)
    assert config["train_config"]["total_steps"] == 6
    assert config["train_config"]["wandb_project"] == "nnsight-lorsa-test"


def test_an_undefined_ce_recovered_is_nan_and_reaches_the_run_as_nan(offline):
    """``ce_zero == ce_orig`` (zero-ablating the site leaves the CE unchanged): the score's denominator is 0, so
    ``ce_recovered`` is undefined: ``nan`` (it was a ``ZeroDivisionError`` in ``to_dict`` / ``summary`` /
    ``log_evaluation``), and W&B records it as NaN next to the other metrics instead of dropping it."""
    ev = Evaluation(fvu=0.25, l0=2.0, dead_frac=0.125, ce_orig=3.0, ce_spliced=3.5, ce_zero=3.0, kl=0.4,
                    n_tokens=96)
    assert math.isnan(ev.ce_recovered)
    assert math.isnan(ev.summary()["ce_recovered"])
    defined = Evaluation(fvu=0.25, l0=2.0, dead_frac=0.125, ce_orig=3.0, ce_spliced=3.5, ce_zero=3.0 + 2.0 ** -40,
                         kl=0.4, n_tokens=96)
    assert defined.ce_recovered == (defined.ce_zero - 3.5) / (defined.ce_zero - 3.0)  # a tiny gap stays a number
    trainer = Trainer(sae(), source, TrainConfig(total_steps=2, log_every=2, wandb_project="nnsight-lorsa-test"))
    trainer.train(progress=False)
    flat = trainer.log_evaluation(ev)
    trainer.close_logging()
    assert math.isnan(flat["eval/ce_recovered"]) and flat["eval/ce_zero"] == 3.0
    rows, _ = logged(offline)
    eval_row = next(r for r in rows if "eval/fvu" in r)
    assert math.isnan(eval_row["eval/ce_recovered"]), eval_row
    assert eval_row["eval/fvu"] == 0.25


def test_a_resumed_trainer_continues_the_same_run(offline, tmp_path):
    trainer = Trainer(sae(), source, TrainConfig(total_steps=4, log_every=1, wandb_project="p"))
    trainer.train(2, progress=False)
    trainer.save_checkpoint(tmp_path / "ckpt")
    first = trainer.wandb_run_id
    trainer.close_logging()
    again = Trainer.resume(tmp_path / "ckpt", source)
    assert again.wandb_run_id == first
    again.train(progress=False)
    assert again.wandb_run_id == first
    again.close_logging()
    # offline, each part of the run is written under the one run id (`wandb sync` joins them)
    files = sorted(offline.glob("wandb/offline-run-*/run-*.wandb"))
    assert files and all(f.name == f"run-{first}.wandb" for f in files), files
    steps = [r["_step"] for f in files for r in logged(offline, f)[0] if "train/loss" in r]
    assert sorted(steps) == [1, 2, 3, 4]  # two steps before the checkpoint, two after the resume


def test_no_project_no_wandb(monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name.split(".")[0] == "wandb":
            raise AssertionError("wandb imported although wandb_project is None")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    trainer = Trainer(sae(), source, TrainConfig(total_steps=2))
    trainer.train(progress=False)
    assert trainer.log_evaluation({"fvu": 0.5, "l0": [1.0, 2.0], "note": "x"}) == {
        "eval/fvu": 0.5, "eval/l0/layer_0": 1.0, "eval/l0/layer_1": 2.0}
    assert trainer.wandb_run_id is None


def test_asking_for_wandb_without_it_is_a_named_error_before_any_step(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    trainer = Trainer(sae(), source, TrainConfig(total_steps=2, wandb_project="p"))
    with pytest.raises(MissingDependencyError, match=r"wandb_project.*pip install 'nnsight-lorsa\[wandb\]'"):
        trainer.train(progress=False)
    assert trainer.step == 0
    with pytest.raises(MissingDependencyError):
        trainer.log_evaluation({"fvu": 0.5})


@pytest.mark.parametrize("value", ["", "  ", 3, b"p", True])
@pytest.mark.parametrize("field", ["wandb_project", "wandb_run_name"])
def test_wandb_fields_are_checked(field, value):
    config = TrainConfig.__new__(TrainConfig)  # through the dataclass's own __init__, not the test-time type check
    with pytest.raises(ArgumentError, match=rf"TrainConfig\.{field} must be None or a non-empty str"):
        inspect.unwrap(TrainConfig.__init__)(config, total_steps=2, **{field: value})


def test_log_evaluation_refuses_other_things():
    trainer = Trainer(sae(), source, TrainConfig(total_steps=2))
    with pytest.raises(ArgumentError, match="Evaluation or a mapping"):
        trainer.log_evaluation([0.5])
