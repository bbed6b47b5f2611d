"""Mutation probe round 9c (``nnsight_lorsa/training/wandb_log.py``): what survived the W&B logging tests.

No network and no wandb service: a fake ``wandb`` module records what ``WandbRun`` asks of it.

* a resumed trainer continues its W&B run with ``resume="allow"`` (the module docstring), a new run has no id;
* ``flat_metrics`` of a history entry: the metric names of the entry, not its ``step`` (the W&B step already).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from nnsight_lorsa.training.wandb_log import WandbRun, flat_metrics


class FakeRun:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.id = kwargs.get("id") or "new-run"
        self.step = 0
        self.logged: list[tuple[dict, int | None]] = []

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.logged.append((metrics, step))
        if step is not None:
            self.step = step

    def finish(self) -> None:
        pass


def fake_wandb(monkeypatch) -> list[FakeRun]:
    runs: list[FakeRun] = []

    def init(**kwargs: Any) -> FakeRun:
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return runs


def test_a_resumed_run_continues_the_same_id_with_resume_allow(monkeypatch):
    runs = fake_wandb(monkeypatch)
    new = WandbRun("proj", "name", {"a": 1})
    assert runs[0].kwargs == {"project": "proj", "name": "name", "config": {"a": 1}} and new.id == "new-run"
    again = WandbRun("proj", None, {}, run_id="abc123")
    assert runs[1].kwargs == {"project": "proj", "name": None, "config": {}, "id": "abc123", "resume": "allow"}
    assert again.id == "abc123"


def test_a_history_entry_is_logged_without_its_step(monkeypatch):
    entry = {"step": 4, "loss": 0.25, "fvu": 0.5, "l0": 3, "lr": 1e-3}
    assert flat_metrics(entry, "train") == {"train/loss": 0.25, "train/fvu": 0.5, "train/l0": 3.0, "train/lr": 1e-3}


def test_per_layer_values_in_a_tuple_are_logged_per_layer():
    assert flat_metrics({"l0": (1.0, 2.0), "fvu": [0.5]}, "eval") == {
        "eval/l0/layer_0": 1.0, "eval/l0/layer_1": 2.0, "eval/fvu/layer_0": 0.5}
