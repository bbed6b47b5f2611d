"""Every writer is crash-safe (nnsight_lorsa._atomic): a writer killed (SIGKILL) at any file boundary
of a save over an existing directory leaves a directory that loads as exactly the old content or
exactly the new one, never a mix, never nothing; a later save over the debris is complete and leaves
no temporaries. A flipped byte or a truncation of any written file is refused with CheckpointError
naming the file. Non-file inputs (Graph.save's meta) are checked before anything is written.

The kill: the writer runs in a forked child whose ``_atomic._boundary`` hook (called after half of
each file, after each file, after each rename) reports the event through a pipe at boundary number
``k`` and waits; the parent SIGKILLs it by pid, for k = 1, 2, … until the save completes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_clt, make_sae, make_transcoder, tiny_hf_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import _atomic
from nnsight_lorsa.errors import ActivationCacheError, ArgumentError, CheckpointError, LorsaError
from nnsight_lorsa.formats import load, save
from nnsight_lorsa.modules.lorsa import Lorsa
from nnsight_lorsa.modules.lorsa_config import LorsaConfig
from nnsight_lorsa.modules.rotary import RotaryConfig

# ------------------------------------------------------------------ what each writer saves and loads


def _lorsa(top_k: int, seed: int) -> Lorsa:
    torch.manual_seed(seed)
    cfg = LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=8, n_ov_heads=16, top_k=top_k,
                      rotary=RotaryConfig(8, 8, 10000.0, False), qk_norm=True, layer=1)
    m = Lorsa(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def _tensors_sig(state: dict[str, torch.Tensor]) -> tuple:
    return tuple((k, str(v.dtype), tuple(v.shape), v.detach().cpu().contiguous().view(-1).view(torch.uint8)
                  .numpy().tobytes() if v.numel() else b"") for k, v in sorted(state.items()))


def _module_sig(m: Any) -> tuple:
    """What a loaded object is: its config and every tensor, bit for bit."""
    if hasattr(m, "transcoders"):  # a circuit-tracer transcoder set
        return tuple((layer, _module_sig(tc)) for layer, tc in sorted(m.transcoders.items()))
    cfg = m.cfg.to_dict() if hasattr(m.cfg, "to_dict") else vars(m.cfg)
    return type(m).__name__, json.dumps(cfg, sort_keys=True, default=str), _tensors_sig(m.state_dict())


def _graph_sig(g: Any) -> tuple:
    tensors = {"adjacency": g.densify(), "values": g.values, "tokens": g.tokens, "kind": g.nodes.kind}
    return g.prompt, json.dumps(g.meta, sort_keys=True), _tensors_sig(tensors)


@dataclass
class Writer:
    name: str
    old: Any
    new: Any
    write: Callable[[Any, Path], Any]
    read: Callable[[Path], Any]  # -> a signature (raises when nothing is there)
    absent_old: bool = False  # the writer refuses to write over an old one: "old" is "no directory"


def _graph_pair(root: Path) -> tuple[Any, Any]:
    from helpers import attribution_setup, random_ids, rm

    from nnsight_lorsa.attribution import Graph, attribute

    model, hf, lorsas, tcs = attribution_setup("llama")
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 4, seed=5)[0], batch_size=16)
    g.meta = {"run": "old"}
    g.save(root / "g")
    new = Graph.load(root / "g")
    new.prompt, new.meta = "the new prompt", {"run": "new"}
    with torch.no_grad():
        new.values.mul_(2)
    return g, new


def _gated(seed: int) -> Any:
    from nnsight_lorsa.sparse_attention import install_gated_attention

    hf = tiny_hf_model("llama")
    gates = install_gated_attention(hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in gates.values():
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=g))
    return hf


def _gates_sig(d: Path) -> tuple:
    from nnsight_lorsa.sparse_attention import load_gates

    gates = load_gates(tiny_hf_model("llama"), d)
    return _tensors_sig({f"{k}": v.bias for k, v in gates.items()})


def _cache_write(seed: int) -> Callable[[Path], Any]:
    from helpers import tiny_training_setup

    from nnsight_lorsa.envoy.read import Site
    from nnsight_lorsa.training.activation_cache import write_activation_cache

    model, hf, adapter, data = tiny_training_setup()
    sites = [Site.resid_post(adapter, 1), Site.mlp_output(adapter, 0)]
    return lambda d: write_activation_cache(model, sites, data, d, batch_size=16, windows_per_shard=16)


def _cache_sig(d: Path) -> tuple:
    from nnsight_lorsa.training.activation_cache import ActivationCache

    c = ActivationCache(d)
    idx = torch.arange(c.n_windows)
    return json.dumps(c.manifest, sort_keys=True), _tensors_sig({n: c.windows(n, idx) for n in c.sites})


RELU: dict[str, Any] = {"activation": "relu", "activation_params": {}}


def _writers(root: Path) -> dict[str, Writer]:
    from nnsight_lorsa.attribution import Graph
    from nnsight_lorsa.sparse_attention.io import save_gates

    read_module = lambda d: _module_sig(load(d))  # noqa: E731
    graph_old, graph_new = _graph_pair(root)
    out = [
        # the case: new weights with the old top_k must never load
        Writer("nnsight_lorsa:Lorsa", _lorsa(2, 0), _lorsa(3, 1), lambda o, d: save(o, d), read_module),
        Writer("nnsight_lorsa:Transcoder", make_transcoder(seed=0), make_transcoder(seed=1, activation_params={"k": 4}),
               lambda o, d: save(o, d), read_module),
        Writer("saelens:SAE", make_sae(seed=0), make_sae(seed=1), lambda o, d: save(o, d, format="saelens"),
               read_module),
        Writer("sparsify:SAE", make_sae(seed=0, activation="topk", activation_params={"k": 4}),
               make_sae(seed=1, activation="topk", activation_params={"k": 6}),
               lambda o, d: save(o, d, format="sparsify"), read_module),
        Writer("llamascopium:Lorsa", _lorsa(2, 0), _lorsa(3, 1), lambda o, d: save(o, d, format="llamascopium"),
               read_module),
        Writer("circuit_tracer:CLT", make_clt(seed=0), make_clt(seed=1),
               lambda o, d: save(o, d, format="circuit_tracer"), read_module),
        Writer("circuit_tracer:transcoders", {0: make_transcoder(False, seed=0, **RELU),
                                              1: make_transcoder(False, seed=1, **RELU)},
               {0: make_transcoder(False, seed=2, **RELU)},
               lambda o, d: save(o, d, format="circuit_tracer"), read_module),
        Writer("Graph.save", graph_old, graph_new, lambda o, d: o.save(d), lambda d: _graph_sig(Graph.load(d))),
        Writer("save_gates", _gated(0), _gated(1), lambda o, d: save_gates(o, d), _gates_sig),
        Writer("write_activation_cache", None, _cache_write(0), lambda w, d: w(d), _cache_sig, absent_old=True),
    ]
    return {w.name: w for w in out}


@pytest.fixture(scope="module")
def writers(tmp_path_factory) -> dict[str, Writer]:
    return _writers(tmp_path_factory.mktemp("writers"))


# ------------------------------------------------------------------ the kill


def _child(write: Callable[[Any, Path], Any], obj: Any, d: Path, stop_at: int, conn: Any) -> None:
    count = 0

    def boundary(event: str) -> None:
        nonlocal count
        count += 1
        if count == stop_at:
            conn.send(event)
            time.sleep(600)

    _atomic._boundary = boundary
    torch.set_num_threads(1)
    write(obj, d)
    conn.send("done")


def _save_killed_at(write: Callable[[Any, Path], Any], obj: Any, d: Path, k: int) -> str:
    """Run ``write(obj, d)`` in a forked child, SIGKILLed at its k-th boundary; the event, or "done"."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(write, obj, d, k, child))
    p.start()
    try:
        assert parent.poll(180), f"the child neither stopped nor finished (k={k})"
        event = parent.recv()
    finally:
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    if event != "done":
        assert p.exitcode == -signal.SIGKILL, (event, p.exitcode)
    return str(event)


WRITERS = ["nnsight_lorsa:Lorsa", "nnsight_lorsa:Transcoder", "saelens:SAE", "sparsify:SAE", "llamascopium:Lorsa",
           "circuit_tracer:CLT", "circuit_tracer:transcoders", "Graph.save", "save_gates", "write_activation_cache"]


@pytest.mark.parametrize("name", WRITERS)
def test_sigkill_at_every_boundary_leaves_old_or_new(writers, tmp_path, name):
    w = writers[name]
    refs = {}
    for label in ("old", "new"):
        if label == "old" and w.absent_old:
            continue
        w.write(getattr(w, label), tmp_path / f"ref_{label}" / "dir")  # the same name (sparsify records it)
        refs[label] = w.read(tmp_path / f"ref_{label}" / "dir")
    assert "old" not in refs or refs["old"] != refs["new"]
    events = []
    for k in range(1, 200):
        d = tmp_path / f"k{k}" / "dir"
        if not w.absent_old:
            w.write(w.old, d)
        event = _save_killed_at(w.write, w.new, d, k)
        if event == "done":
            break
        events.append(event)
        renamed = "rename:new" in events
        if renamed or not w.absent_old:
            got = w.read(d)
            assert got == refs["new" if renamed else "old"], (name, k, event)  # exactly one, never a mix
        else:
            with pytest.raises(ActivationCacheError):
                w.read(d)
        # a later save over the debris (a stale temporary, a dir.old) is complete and cleans up
        if not (w.absent_old and renamed):
            w.write(w.new, d)
        assert w.read(d) == refs["new"], (name, k, event)
        assert sorted(p.name for p in d.parent.iterdir()) == ["dir"], (name, k, event)
    # every file was cut in half and completed, then the manifest, then the swap
    assert events[-2:] == ["rename:new", "removed:old"], events
    assert any(e.startswith("partial:") for e in events) and f"file:{_atomic.MANIFEST}" in events
    assert (not w.absent_old) == ("rename:old" in events)
    assert len(events) >= 6


# ------------------------------------------------------------------ damaged files are refused, named

DAMAGEABLE = ["nnsight_lorsa:Lorsa", "saelens:SAE", "sparsify:SAE", "llamascopium:Lorsa", "circuit_tracer:CLT",
              "Graph.save", "save_gates", "write_activation_cache"]


@pytest.fixture(scope="module")
def written(writers, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("written")
    out = {}
    for name in DAMAGEABLE:
        w = writers[name]
        w.write(w.new, root / name.replace(":", "_"))
        out[name] = root / name.replace(":", "_")
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_byte_or_truncation_is_refused_naming_the_file(writers, written, data):
    """Any bit of any written file flipped, or the file cut at any length: never loads."""
    name = data.draw(st.sampled_from(DAMAGEABLE), label="writer")
    base = written[name]
    files = sorted(p.name for p in base.iterdir() if p.name != _atomic.MANIFEST)
    victim = data.draw(st.sampled_from(files), label="file")
    raw = (base / victim).read_bytes()
    truncate = data.draw(st.booleans(), label="truncate")
    if truncate:
        cut = data.draw(st.integers(0, len(raw) - 1), label="length")
        damaged = raw[:cut]
    else:
        at = data.draw(st.integers(0, len(raw) - 1), label="offset")
        bit = data.draw(st.integers(0, 7), label="bit")
        damaged = raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1:]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "d"
        d.mkdir()
        for p in base.iterdir():
            (d / p.name).write_bytes(p.read_bytes())
        (d / victim).write_bytes(damaged)
        # the reader's own named error when it refuses the file (naming it and the key), else the manifest's
        with pytest.raises(LorsaError) as info:
            writers[name].read(d)
        assert victim in str(info.value), str(info.value)
        assert isinstance(info.value, CheckpointError) or "key" in str(info.value), repr(info.value)


def test_a_damaged_manifest_or_listed_file_is_refused(written):
    d = written["nnsight_lorsa:Lorsa"]
    assert sorted(_atomic.verify(d)) == ["config.json", "model.safetensors"]
    with tempfile.TemporaryDirectory() as tmp:
        c = Path(tmp) / "c"
        c.mkdir()
        for p in d.iterdir():
            (c / p.name).write_bytes(p.read_bytes())
        (c / "model.safetensors").unlink()
        with pytest.raises(CheckpointError, match="model.safetensors"):
            load(c, format="nnsight_lorsa")
        (c / _atomic.MANIFEST).write_text("{not json")
        with pytest.raises(CheckpointError, match="checksums.json: corrupt"):
            _atomic.verify(c)


def test_directories_without_a_manifest_load_as_before(written, writers):
    """Older versions' and the peers' own directories have no checksums.json: read unchecked."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("saelens:SAE", "sparsify:SAE", "Graph.save"):
            c = Path(tmp) / name.replace(":", "_")
            c.mkdir()
            for p in written[name].iterdir():
                if p.name != _atomic.MANIFEST:
                    (c / p.name).write_bytes(p.read_bytes())
            assert writers[name].read(c) == writers[name].read(written[name])


# ------------------------------------------------------------------ inputs checked before writing


def test_graph_save_checks_meta_before_writing(writers, tmp_path):
    w = writers["Graph.save"]
    d = w.old.save(tmp_path / "g")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    bad = w.new
    meta = bad.meta
    try:
        bad.meta = {"when": object()}
        with pytest.raises(ArgumentError, match="meta"):
            bad.save(d)
    finally:
        bad.meta = meta
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # no staging left behind


def test_a_failing_writer_leaves_the_old_directory(tmp_path):
    d = save(_lorsa(2, 0), tmp_path / "x")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(RuntimeError), _atomic.atomic_directory(d) as stage:
        stage.write_text("config.json", "{}")
        raise RuntimeError("the writer failed half way")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_unrelated_files_are_kept_and_replaced_files_dropped(tmp_path):
    d = tmp_path / "x"
    save(make_sae(seed=0), d, format="saelens")
    (d / "README.md").write_text("mine")
    (d / "notes").mkdir()
    (d / "notes" / "a.txt").write_text("a")
    save(_lorsa(2, 0), d)  # another format over ours: the SAELens files go, the user's stay
    assert sorted(p.name for p in d.iterdir()) == ["README.md", "checksums.json", "config.json",
                                                     "model.safetensors", "notes"]
    assert (d / "notes" / "a.txt").read_text() == "a" and (d / "README.md").read_text() == "mine"
    assert isinstance(load(d), Lorsa)


def test_save_gates_keeps_the_model_beside_them(tmp_path):
    from nnsight_lorsa.sparse_attention import save_sparse_model
    from nnsight_lorsa.sparse_attention.io import load_sparse_model, save_gates

    hf = _gated(0)
    d = save_sparse_model(hf, tmp_path / "m")
    model_files = {n: v for n, v in _atomic.verify(d).items() if not n.startswith("sparse_attention")}
    assert "model.safetensors" in model_files
    save_gates(_gated(1), d)
    after = _atomic.verify(d)
    assert {n: after[n] for n in model_files} == model_files
    assert load_sparse_model(d) is not None


@settings(max_examples=25, deadline=None)
@given(old=st.binary(max_size=64), new=st.binary(max_size=64), k=st.integers(1, 3))
def test_atomic_file_is_old_or_new(old, new, k):
    """Single-file exports (save_neuronpedia, render_html(path=), write_dashboard): a sibling temporary
    renamed over the file."""
    def write(data: bytes, p: Path) -> None:
        _atomic.atomic_file(p, data)

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "graph.json"
        p.write_bytes(old)
        event = _save_killed_at(write, new, p, k)
        assert p.read_bytes() == (old if event == "file:graph.json" else new), event
        _atomic.atomic_file(p, new)  # a later write removes a killed one's temporary
        assert [q.name for q in Path(tmp).iterdir()] == ["graph.json"]


def test_a_damaged_file_is_named_not_the_file_it_points_at(writers, written, tmp_path):
    """Two damages a random search found blamed on another file: a cache manifest whose shard name lost a
    byte (the checksum of manifest.json is checked before any field of it is believed), and a Llamascopium
    config whose RoPE base changed (no checksum there: the mismatch message names config.json too)."""
    import shutil

    d = tmp_path / "cache"
    shutil.copytree(written["write_activation_cache"], d)
    text = (d / "manifest.json").read_text()
    assert "shard_00001" in text
    (d / "manifest.json").write_text(text.replace("shard_00001", "shard_0000q", 1))
    with pytest.raises(LorsaError, match="manifest.json"):
        writers["write_activation_cache"].read(d)
    d = tmp_path / "lorsa"
    shutil.copytree(written["llamascopium:Lorsa"], d)
    cfg = json.loads((d / "config.json").read_text())
    key = next(k for k in ("rotary_base", "rope_theta") if k in cfg)
    cfg[key] = float(cfg[key]) * 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json"):
        writers["llamascopium:Lorsa"].read(d)
