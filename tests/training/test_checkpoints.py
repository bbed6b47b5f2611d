"""Checkpoints are atomic and verified: a damaged file raises CheckpointError naming it, and a run
killed (SIGKILL) at any file boundary of a save resumes bit-exactly from the last complete checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import ActivationSource, TrainConfig, Trainer

LAYER = 1
ROOT = Path(__file__).resolve().parents[2]
FILES = ["coder.safetensors", "optimizer.safetensors", "state.safetensors", "trainer.json", "manifest.json"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, hf, adapter, data = tiny_training_setup()
    source = ActivationSource.sae(model, Site.resid_post(adapter, LAYER), data, batch_size=8)
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=adapter.d_model, d_sae=64, activation="topk",
                                      activation_params={"k": 4}))
    trainer = Trainer(sae, source, TrainConfig(total_steps=2))
    trainer.train(progress=False)
    d = tmp_path_factory.mktemp("ckpt") / "ckpt"
    trainer.save_checkpoint(d)
    return d, source


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_save_writes_a_manifest_and_leaves_no_temporaries(saved):
    d, source = saved
    assert sorted(f.name for f in d.iterdir()) == sorted(FILES)
    assert [p.name for p in d.parent.iterdir()] == ["ckpt"]
    manifest = json.loads((d / "manifest.json").read_text())["files"]
    assert sorted(manifest) == sorted(FILES[:-1])
    assert all(manifest[n]["size"] == (d / n).stat().st_size for n in manifest)
    assert Trainer.resume(d, source).step == 2


@pytest.mark.parametrize("name", FILES[:-1])
@pytest.mark.parametrize("damage", ["missing", "truncated", "altered"])
def test_damaged_file_raises_naming_it(saved, tmp_path, name, damage):
    d, source = saved
    c = _copy(d, tmp_path / "c")
    data = (c / name).read_bytes()
    if damage == "missing":
        (c / name).unlink()
    elif damage == "truncated":
        (c / name).write_bytes(data[: len(data) // 2])
    else:  # same size, one byte flipped
        (c / name).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"{name}: {damage}") as e:
        Trainer.resume(c, source)
    # a training checkpoint's manifest is required: the advice is not to delete it (that left it unloadable)
    assert "delete" not in str(e.value) and (damage != "altered" or "save the checkpoint again" in str(e.value))
    with pytest.raises(CheckpointError, match=name):
        Trainer.load_checkpoint(c)


@pytest.mark.parametrize("content", [None, b"{not json", b'{"files": 3}', b'{"format": 1}'])
def test_missing_or_corrupt_manifest_raises(saved, tmp_path, content):
    """Also what a checkpoint written before manifests existed gets: refused, never read unchecked."""
    d, source = saved
    c = _copy(d, tmp_path / "c")
    if content is None:
        (c / "manifest.json").unlink()
    else:
        (c / "manifest.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="manifest.json: (missing|corrupt) checkpoint manifest"):
        Trainer.resume(c, source)


def test_save_refuses_to_replace_a_foreign_directory(saved, tmp_path):
    d, source = saved
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        Trainer.resume(d, source).save_checkpoint(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep"


# ---------------------------------------------------------------- SIGKILL at every file boundary
# A tiny SAE on synthetic batches (batch i depends only on i), shared by this process and the child.
COMMON = """
import torch
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch

def source(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, 8, 16, generator=g)
    mask = torch.ones(4, 8, dtype=torch.bool)
    mask[:, 0] = False
    return Batch(x=x, y=x, loss_mask=mask)

def new_trainer():
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=16, d_sae=64, activation="topk", activation_params={"k": 4}))
    return Trainer(sae, source, TrainConfig(total_steps=6, lr=1e-2, dead_after_tokens=20, norm_batches=2))
"""

# The child trains with a checkpoint every 2 steps; at boundary number STOP_AT of its saves (a file
# written, a rename) it says so and waits to be killed.
CHILD = COMMON + """
import os, sys, time
from nnsight_lorsa.training import checkpoint_io as _checkpoint_io
count = 0
def boundary(event):
    global count
    count += 1
    if count == int(os.environ["STOP_AT"]):
        print(event, flush=True)
        time.sleep(600)
_checkpoint_io._boundary = boundary
new_trainer().train(progress=False, checkpoint_dir=sys.argv[1], checkpoint_every=2)
print("done", flush=True)
"""

FIRST_SAVE = 7  # 5 files, rename into place, (nothing old to remove): boundaries of the step-2 save
SECOND_SAVE = 8  # 5 files, old aside, new into place, old removed: the step-4 save


def test_sigkill_at_every_save_boundary_resumes_bit_exactly(tmp_path):
    ns: dict = {}
    exec(COMMON, ns)
    straight = ns["new_trainer"]()
    straight.train(progress=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    events = []
    for k in range(1, SECOND_SAVE + 1):
        d = tmp_path / f"run{k}" / "ckpt"
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(d)], stdout=subprocess.PIPE, text=True,
                                 env={**env, "STOP_AT": str(FIRST_SAVE + k)}, cwd=ROOT)
        assert child.stdout is not None
        event = child.stdout.readline().strip()
        assert event and event != "done", event
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL
        events.append(event)
        resumed = Trainer.resume(d, ns["source"])
        # the step-4 checkpoint counts from the moment it is renamed into place
        assert resumed.step == (4 if k >= 7 else 2), (k, event)
        resumed.train(progress=False)
        for (name, a), b in zip(straight.module.state_dict().items(), resumed.module.state_dict().values(),
                                strict=True):
            assert torch.equal(a, b), (k, event, name)
        assert torch.equal(straight.tokens_since_fired, resumed.tokens_since_fired), (k, event)
        # a later save over the debris (a stale temporary or a ckpt.old) works and is complete
        resumed.save_checkpoint(d)
        assert sorted(p.name for p in d.parent.iterdir()) == ["ckpt"]  # no .old, no stale .tmp-<pid>
        assert Trainer.resume(d, ns["source"]).step == 6
    assert events == [f"file:{n}" for n in FILES] + ["rename:old", "rename:new", "removed:old"]


def test_checkpoints_stream_their_tensor_files_without_an_in_memory_copy(saved, tmp_path, monkeypatch):
    """Seen failing: both trainers serialised each checkpoint file in memory (``safetensors.torch.save``: the module
    and its Adam state twice over at a save). Now streamed from the tensors (``save_file``); the checkpoint resumes
    to the same tensors."""
    import safetensors.torch
    from helpers import tiny_hf_model
    from safetensors.torch import load_file

    from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig

    def serialised(*args, **kwargs):
        raise AssertionError("a checkpoint file was serialised in memory (safetensors.serialize)")

    d, source = saved
    trainer = Trainer.resume(d, source)
    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    sparse = SparseAttentionTrainer(tiny_hf_model("llama"), stream, SparseTrainConfig(
        total_steps=1, batch_size=2, seq_len=16, target_batches=1))
    monkeypatch.setattr(safetensors.torch, "serialize", serialised)
    trainer.save_checkpoint(tmp_path / "coder")
    sparse.save_checkpoint(tmp_path / "sparse")
    monkeypatch.undo()
    for name in FILES[:3]:
        want, got = load_file(d / name), load_file(tmp_path / "coder" / name)
        assert sorted(want) == sorted(got), name
        for k in want:
            assert torch.equal(want[k], got[k]), (name, k)
    sparse.load_checkpoint(tmp_path / "sparse")
