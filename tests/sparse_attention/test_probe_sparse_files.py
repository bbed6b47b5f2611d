"""Checkpointing and sparse-attention files probe (2026-11-28), the sparse-attention files' part
(:mod:`nnsight_lorsa.sparse_attention.io`, :mod:`nnsight_lorsa.formats.gate_format`): save -> load round trips of
drawn gated models, the loaders' ``dtype`` / ``device``, bad and foreign files, and ``save_sparse_model`` failing at
every boundary over an earlier save."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import generated, tiny_hf_model
from hypothesis import strategies as st
from test_atomic_writes import Writer, _gated, _tensors_sig
from test_probe_interrupt_round2 import WRITE_FAILURES, check_writer_failing_at, writer_events

from nnsight_lorsa.errors import CheckpointError, GateConfigError, GateNotInstalledError
from nnsight_lorsa.formats import load
from nnsight_lorsa.sparse_attention import install_gated_attention, load_gates, set_gate_mode
from nnsight_lorsa.sparse_attention.install import get_gates
from nnsight_lorsa.sparse_attention.io import load_sparse_model, save_gates, save_sparse_model


def _in_dtype(model, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """``model`` with its parameters in ``dtype``, as ``from_pretrained(..., dtype=)`` makes it (``.to(dtype)`` also
    rounds the rotary ``inv_freq`` buffers, which transformers recomputes in fp32 at a load: other logits)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def _gate_settings(model) -> list:  # type: ignore[no-untyped-def]
    return [(layer, g.temperature, g.mode, g.top_k) for layer, g in get_gates(model).items()]


@generated(2, 24, family=st.sampled_from(["llama", "gpt2", "neox", "qwen3", "gemma2"]),
           dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
           temperature=st.floats(0.1, 4.0), mode=st.sampled_from(["gated", "topk", "dense"]), top_k=st.integers(1, 4),
           seed=st.integers(0, 2**16))
def test_a_gated_model_round_trips_bit_for_bit(tmp_path_factory, family, dtype, temperature, mode, top_k, seed):
    """A drawn family in a drawn dtype, gates with random biases and drawn settings: ``load_sparse_model`` gives
    every weight in the saved dtype bit for bit, the gates' fp32 biases and settings, the same logits; ``dtype=``
    gives that dtype (the gates fp32); ``load_gates`` onto a fresh model of the family gives the same gates."""
    hf = _in_dtype(tiny_hf_model(family), dtype)
    gates = install_gated_attention(hf, temperature=temperature)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in gates.values():
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=g) * 3)
    set_gate_mode(hf, mode, top_k)
    d = tmp_path_factory.mktemp("m") / "m"
    save_sparse_model(hf, d)
    loaded = load_sparse_model(d)
    assert _tensors_sig(loaded.state_dict()) == _tensors_sig(hf.state_dict())
    assert {g.bias.dtype for g in get_gates(loaded).values()} == {torch.float32}
    assert _gate_settings(loaded) == _gate_settings(hf)
    ids = torch.randint(3, 100, (2, 7), generator=g)
    hf.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf(ids).logits)
    widened = load_sparse_model(d, dtype=torch.float32)
    assert {p.dtype for n, p in widened.named_parameters()} == {torch.float32}
    fresh = _in_dtype(tiny_hf_model(family), dtype)
    again = load_gates(fresh, d)
    assert _tensors_sig({str(k): v.bias for k, v in again.items()}) == \
        _tensors_sig({str(k): v.bias for k, v in gates.items()})
    assert _gate_settings(fresh) == _gate_settings(hf)


def test_settings_and_mode_come_back(tmp_path):
    """(Mutations 22, 26, 27: ``load_gates`` without ``top_k``, ``load_sparse_model`` / the gate reader without
    ``eval()`` survived.) A top-3 model at temperature 0.5 loads as one, in eval mode."""
    hf = _gated(0)
    for gate in get_gates(hf).values():
        gate.temperature = 0.5
    set_gate_mode(hf, "topk", 3)
    save_sparse_model(hf.train(), tmp_path / "m")
    loaded = load_sparse_model(tmp_path / "m")
    assert _gate_settings(loaded) == [(layer, 0.5, "topk", 3) for layer in range(3)]
    assert not any(m.training for m in loaded.modules())
    assert not any(g.training for g in load(tmp_path / "m", format="sparse_attention").gates.values())


def test_the_gate_files_load_on_the_meta_device(tmp_path):
    """``load(..., format="sparse_attention", device="meta")`` (shapes only, the documented header read) raised
    torch's ``NotImplementedError`` ("Cannot copy out of meta tensor"): the bias was copied into a CPU gate before the
    move. Seen failing; now the gates come on ``meta`` with the saved settings."""
    hf = _gated(0)
    save_gates(hf, tmp_path)
    gate_set = load(tmp_path, format="sparse_attention", device="meta")
    assert {p.device.type for g in gate_set.gates.values() for p in g.parameters()} == {"meta"}
    assert [tuple(g.bias.shape) for g in gate_set.gates.values()] == [(4,)] * 3


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_model_file_is_refused_before_transformers_reads_it(tmp_path, name, damage):
    """``checksums.json`` was checked after ``from_pretrained``: a truncated ``model.safetensors`` raised
    safetensors' ``SafetensorError``, a truncated ``config.json`` transformers' ``OSError``. Seen failing; now our
    ``CheckpointError`` names the file, before transformers opens it."""
    save_sparse_model(_gated(0), tmp_path / "m")
    data = (tmp_path / "m" / name).read_bytes()
    (tmp_path / "m" / name).write_bytes(data[: len(data) // 2] if damage == "truncated"
                                        else data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    with pytest.raises(CheckpointError, match=f"{name}: (truncated|altered)"):
        load_sparse_model(tmp_path / "m")


def test_load_sparse_model_of_what_is_not_a_saved_model_is_refused_by_name(tmp_path):
    """A directory of gates only, a missing directory: transformers' ``ValueError`` ("Unrecognized model") and
    ``OSError`` ("Repo id must be ...": the path taken for a Hub id). Seen failing; now ``CheckpointError``."""
    save_gates(_gated(0), tmp_path / "gates")
    for d in (tmp_path / "gates", tmp_path / "nothing"):
        with pytest.raises(CheckpointError, match="config.json: missing"):
            load_sparse_model(d)


@pytest.mark.parametrize("setting", ["temperature", "mode", "top_k"])
@pytest.mark.parametrize("saver", ["save_gates", "save_sparse_model"])
def test_gates_whose_settings_differ_by_layer_are_refused_at_save(tmp_path, setting, saver):
    """The gate files hold one temperature / mode / top_k (layer 0's): a layer set on its own was saved as layer 0's
    and loaded so, silently. Seen failing; now refused, nothing written."""
    hf = _gated(0)
    gate = get_gates(hf)[1]
    setattr(gate, setting, {"temperature": 0.25, "mode": "topk", "top_k": 3}[setting])
    with pytest.raises(GateConfigError, match=f"layer 1's gate has .*{gate.mode!r}"):
        (save_gates if saver == "save_gates" else save_sparse_model)(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("edit", "match"), [
    (lambda c: c.__setitem__("n_heads", 8), "do not fit a llama model with 3 layers x 4 heads"),
    (lambda c: c.__setitem__("model_type", "gpt2"), "gates for a gpt2 model"),
    (lambda c: c.__setitem__("temperature", -1.0), "temperature"),
    (lambda c: c.__setitem__("mode", "sparse"), "mode"),
    (lambda c: c.__setitem__("extra", 1), "unknown keys"),
    (lambda c: c.pop("model_type"), "model_type"),
    (lambda c: c.__setitem__("format", "nnsight_lorsa.lorsa"), "key 'format'"),
], ids=["heads", "model type", "temperature", "mode", "extra key", "missing key", "another format"])
def test_a_gate_config_that_does_not_fit_is_refused_by_name_and_installs_nothing(tmp_path, edit, match):
    """(Found fine.) ``sparse_attention.json`` edited (its checksum manifest dropped, as on purpose): refused with
    ``CheckpointError`` naming the file, and the model left without gates."""
    save_gates(_gated(0), tmp_path)
    cfg = json.loads((tmp_path / "sparse_attention.json").read_text())
    edit(cfg)
    (tmp_path / "sparse_attention.json").write_text(json.dumps(cfg))
    (tmp_path / "checksums.json").unlink()
    fresh = tiny_hf_model("llama")
    with pytest.raises(CheckpointError, match=match):
        load_gates(fresh, tmp_path)
    with pytest.raises(GateNotInstalledError):
        get_gates(fresh)


# ---------------------------------------------------------------- save_sparse_model failing part-way
def _sparse_model_sig(d: Path) -> tuple:
    model = load_sparse_model(d)
    return _tensors_sig(model.state_dict()), tuple(_gate_settings(model))


def _sparse_model_writer() -> Writer:
    old, new = _gated(0), _gated(1)
    with torch.no_grad():
        next(new.parameters()).add_(1.0)  # the model's weights differ too, not only the gates
    set_gate_mode(new, "topk", 2)
    return Writer("save_sparse_model", old, new, lambda m, d: save_sparse_model(m, d), _sparse_model_sig)


@pytest.fixture(scope="module")
def sparse_writer() -> Writer:
    return _sparse_model_writer()


@generated(2, 20, k=st.integers(1, 12), failure=st.sampled_from(sorted(WRITE_FAILURES)))
def test_save_sparse_model_failing_part_way_leaves_the_old_model_or_the_new(sparse_writer, tmp_path_factory, k,
                                                                              failure):
    """``save_sparse_model`` over an earlier save, failing at a drawn boundary (half a file, a file, the manifest,
    each rename) with Ctrl-C, a CUDA OOM, a ``RuntimeError`` or a full disk: the injected exception (the full disk as
    our ``SaveError``), the directory loads as the old model (past the last rename: the new one) bit for bit, nothing
    beside it, and the retry gives the new model. (The round-2 interruption probe swept ``save_gates``, not this.)"""
    root = tmp_path_factory.mktemp("w")
    events, _ = writer_events(sparse_writer, root, "save_sparse_model")
    check_writer_failing_at(sparse_writer, root, "save_sparse_model", (k - 1) % len(events) + 1, failure)


def test_a_failed_save_sparse_model_in_transformers_keeps_the_old_model(tmp_path, monkeypatch):
    """The disk filling up inside ``save_pretrained`` (a write of transformers, not ours): our ``SaveError`` naming
    the directory, the old model intact and nothing beside it."""
    from nnsight_lorsa.errors import SaveError

    old, new = _gated(0), _gated(1)
    save_sparse_model(old, tmp_path / "m")
    want = _sparse_model_sig(tmp_path / "m")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(type(new), "save_pretrained", full)
    with pytest.raises(SaveError, match=r"m: the save failed while writing its files .*intact"):
        save_sparse_model(new, tmp_path / "m")
    monkeypatch.undo()
    assert _sparse_model_sig(tmp_path / "m") == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    shutil.rmtree(tmp_path / "m")
