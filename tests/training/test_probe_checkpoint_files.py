"""Checkpointing and sparse-attention files probe (2026-11-28), the trainers' part: save -> resume round trips
against an uninterrupted run, and checkpoints whose files were changed *with a matching manifest* (an edited or
foreign file re-manifested: the sha256 manifest catches damage, not a consistent file of another kind).

Every such file must end in :class:`CheckpointError` naming the file and the entry, with the trainer it was
restored into untouched — never a raw ``KeyError`` / ``TypeError`` / ``RuntimeError``, a failure at the next step,
or a silent load."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import generated, reconstruction_source, tiny_hf_model
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_probe_interrupt import same_state
from test_probe_interrupt_round2 import full_state, round2_batches, round2_trainer, straight_run

from nnsight_lorsa.errors import CheckpointError, ConfigMismatchError, PlacementError
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import TrainConfig, Trainer


def remanifest(d: Path, manifest: str = "manifest.json") -> None:
    """Rewrite ``d``'s manifest for its current files (as an edit made on purpose would)."""
    files = {}
    for p in sorted(d.iterdir()):
        if p.name != manifest:
            b = p.read_bytes()
            files[p.name] = {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    (d / manifest).write_text(json.dumps({"format": 1, "files": files}))


def edited(base: Path, dst: Path, file: str, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of checkpoint ``base`` with ``file`` edited (tensors: ``edit(dict)``; JSON: ``edit(obj)``),
    re-manifested."""
    shutil.copytree(base, dst)
    if file.endswith(".safetensors"):
        tensors = load_file(dst / file)
        edit(tensors)
        save_file(tensors, dst / file)
    else:
        obj = json.loads((dst / file).read_text())
        edit(obj)
        (dst / file).write_text(json.dumps(obj))
    remanifest(dst)
    return dst


_source = reconstruction_source(4, 8, 16)


def _sae_trainer(dtype: torch.dtype = torch.float32) -> Trainer:
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=16, d_sae=64, activation="topk", activation_params={"k": 4})).to(dtype)
    return Trainer(sae, _source, TrainConfig(total_steps=6, lr=1e-2, dead_after_tokens=20, norm_batches=2))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    trainer = _sae_trainer()
    trainer.train(3, progress=False)
    d = tmp_path_factory.mktemp("base") / "ckpt"
    trainer.save_checkpoint(d)
    return d


def _set(key, value):  # type: ignore[no-untyped-def]
    return lambda obj: obj.__setitem__(key, value(obj) if callable(value) else value)


# (id, file, edit, what the message must say). Each of these resumed before the fix: with a raw error at the resume
# (KeyError, TypeError) or the next step (RuntimeError, KeyError, IndexError), or silently.
TAMPERED = [
    ("moment of another shape", "optimizer.safetensors", _set("W_dec.exp_avg", torch.zeros(5)),
     r"optimizer.safetensors: the Adam entry 'W_dec.exp_avg' is torch.float32 \(5,\)"),
    ("moment missing", "optimizer.safetensors", lambda t: t.pop("W_dec.exp_avg"),
     r"optimizer.safetensors: the Adam state of 'W_dec' lacks \['exp_avg'\]"),
    ("unknown Adam slot", "optimizer.safetensors", _set("W_dec.bogus", torch.zeros(3)),
     r"optimizer.safetensors: unknown Adam entry 'W_dec.bogus'"),
    ("int moment", "optimizer.safetensors", _set("W_dec.exp_avg", lambda t: t["W_dec.exp_avg"].to(torch.int32)),
     r"optimizer.safetensors: the Adam entry 'W_dec.exp_avg' is torch.int32"),
    ("Adam step of 3 entries", "optimizer.safetensors", _set("W_dec.step", torch.zeros(3)),
     r"optimizer.safetensors: the Adam entry 'W_dec.step' is torch.float32 \(3,\)"),
    ("NaN moment", "optimizer.safetensors",
     _set("W_enc.exp_avg_sq", lambda t: t["W_enc.exp_avg_sq"].fill_(float("nan"))),
     r"optimizer.safetensors: the tensor 'W_enc.exp_avg_sq' holds 1024 non-finite"),
    ("counters renamed", "state.safetensors", lambda t: t.__setitem__("other", t.pop("tokens_since_fired")),
     r"state.safetensors: holds \['other'\], not the one tensor 'tokens_since_fired'"),
    ("counters of another shape", "state.safetensors", _set("tokens_since_fired", torch.zeros(5, dtype=torch.long)),
     r"state.safetensors: 'tokens_since_fired' is torch.int64 \(5,\); this SparseAutoencoder counts "
     r"torch.int64 \(64,\)"),
    ("float counters", "state.safetensors", _set("tokens_since_fired", lambda t: t["tokens_since_fired"].float()),
     r"state.safetensors: 'tokens_since_fired' is torch.float32"),
    ("extra state tensor", "state.safetensors", _set("x", torch.zeros(2)), r"state.safetensors: holds \["),
    ("int weight", "coder.safetensors", _set("W_dec", lambda t: t["W_dec"].to(torch.int64)),
     r"coder.safetensors: the parameter 'W_dec' is saved as torch.int64"),
    ("one weight in fp64", "coder.safetensors", _set("W_dec", lambda t: t["W_dec"].double()),
     r"coder.safetensors: the parameters are saved in several dtypes"),
    ("NaN weight", "coder.safetensors", _set("b_enc", lambda t: t["b_enc"].fill_(float("inf"))),
     r"coder.safetensors: the tensor 'b_enc' holds 64 non-finite"),
    ("step missing", "trainer.json", lambda m: m.pop("step"),
     r"trainer.json: key 'step' must be an int >= 0, got None"),
    ("step a string", "trainer.json", _set("step", "3"), r"trainer.json: key 'step' must be an int >= 0, got '3'"),
    ("step negative", "trainer.json", _set("step", -1), r"key 'step' must be an int >= 0, got -1"),
    ("step fractional", "trainer.json", _set("step", 2.5), r"key 'step' must be an int >= 0, got 2.5"),
    ("s_in missing", "trainer.json", lambda m: m.pop("s_in"), r"trainer.json: key 's_in' must be a positive finite"),
    ("s_out a string", "trainer.json", _set("s_out", "x"), r"key 's_out' must be a positive finite number .* got 'x'"),
    ("s_in negative", "trainer.json", _set("s_in", -1.0), r"key 's_in' must be a positive finite number .* got -1.0"),
    # 2026-11-29: a parameter's whole Adam state gone resumed with fresh moments for it (taken as never stepped)
    ("a parameter's whole Adam state missing", "optimizer.safetensors",
     lambda t: [t.pop(k) for k in [k for k in t if k.startswith("W_dec.")]],
     r"optimizer.safetensors: holds Adam state for other parameters than .*trainer.json lists .*missing \['W_dec'\]"),
    ("a parameter's Adam state not listed", "trainer.json",
     lambda m: m.__setitem__("adam_params", [n for n in m["adam_params"] if n != "b_enc"]),
     r"optimizer.safetensors: holds Adam state .*not listed \['b_enc'\]"),
    ("adam_params not a list", "trainer.json", _set("adam_params", "W_dec"),
     r"trainer.json: key 'adam_params' must be a list of parameter names, got 'W_dec'"),
]


@pytest.mark.parametrize(("file", "edit", "match"), [c[1:] for c in TAMPERED], ids=[c[0] for c in TAMPERED])
def test_a_consistent_file_of_another_kind_is_refused_by_name(base, tmp_path, file, edit, match):
    """Seen failing before the fix (each case: a raw error at the resume or at the next step, or a silent resume).
    ``Trainer.restore_state`` into a trained trainer refuses it too and leaves that trainer as it was."""
    c = edited(base, tmp_path / "c", file, edit)
    with pytest.raises(CheckpointError, match=match):
        Trainer.resume(c, _source)
    if file == "coder.safetensors":
        return  # read by resume / load_checkpoint only
    trainer = _sae_trainer()
    trainer.train(2, progress=False)
    before = full_state(trainer)
    meta = json.loads((c / "trainer.json").read_text())
    with pytest.raises(CheckpointError, match=match):
        trainer.restore_state(c, meta)
    assert same_state(full_state(trainer), before)


def _assert_same_trainer(a: Trainer, b: Trainer) -> None:
    """Bit for bit: the module (parameters, buffers, dtypes), the Adam state by parameter name, the step, the dead
    counters, the scale factors, the learning rates, the fp32 masters."""
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    names_a = {id(a.masters.held(p)): n for n, p in a.module.named_parameters()}
    names_b = {id(b.masters.held(p)): n for n, p in b.module.named_parameters()}
    adam_a = {names_a[id(p)]: s for p, s in a.optimizer.state.items()}
    adam_b = {names_b[id(p)]: s for p, s in b.optimizer.state.items()}
    assert sorted(adam_a) == sorted(adam_b)
    for n, s in adam_a.items():
        assert sorted(s) == sorted(adam_b[n]), n
        for slot, v in s.items():
            assert v.dtype == adam_b[n][slot].dtype and torch.equal(v, adam_b[n][slot]), (n, slot)
    assert (a.step, a.s_in, a.s_out, a.s_in_layers, a.s_out_layers) == (b.step, b.s_in, b.s_out, b.s_in_layers,
                                                                         b.s_out_layers)
    assert torch.equal(a.tokens_since_fired, b.tokens_since_fired)
    assert [g["lr"] for g in a.optimizer.param_groups] == [g["lr"] for g in b.optimizer.param_groups]
    assert (a.run_info, a.wandb_run_id) == (b.run_info, b.wandb_run_id)
    for p in a.optimizer.state:  # each moment in its (master) parameter's dtype
        assert all(v.dtype == p.dtype for k, v in a.optimizer.state[p].items() if k != "step")
    ma, mb = a.masters.named(a.module), b.masters.named(b.module)
    assert sorted(ma) == sorted(mb) and all(torch.equal(ma[n], mb[n]) for n in ma)


@generated(3, 40, kind=st.sampled_from(["clt", "transcoder", "lorsa"]), save_at=st.integers(0, 4))
def test_a_resumed_run_is_the_uninterrupted_one(tmp_path_factory, kind, save_at):
    """A fp64 CLT (BatchTopK thresholds, skip), skip transcoder (JumpReLU) or Lorsa (initialised on the first step,
    k annealed), AuxK on, checkpointed after a drawn step (0: before any) and resumed: the resumed trainer is the
    saved one bit for bit (module, Adam state by name, step, counters, scale factors, LR), and trained on to the end
    it is the uninterrupted run's state bit for bit."""
    batches = round2_batches(kind)
    trainer, _ = round2_trainer(kind, batches)
    while trainer.step < save_at:
        trainer.train_step()
    trainer.run_info, trainer.wandb_run_id = {"seed": save_at, "data": "drawn"}, f"run-{kind}"
    d = tmp_path_factory.mktemp("ckpt") / "c"
    trainer.save_checkpoint(d)
    resumed = Trainer.resume(d, batches.__getitem__)
    _assert_same_trainer(trainer, resumed)
    while resumed.step < 5:
        resumed.train_step()
    assert same_state(full_state(resumed), straight_run(kind))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32, torch.float64])
def test_a_bf16_run_resumes_in_the_dtype_asked_for(tmp_path, dtype):
    """A bf16 SAE (fp32 masters) saved after 3 steps: resumed by default it is the saved trainer bit for bit and
    trains on as the uninterrupted run; ``dtype=`` gives a module of that dtype whose values are the fp32 masters
    (rounded to bf16, or exact in fp32 / fp64)."""
    straight = _sae_trainer(torch.bfloat16)
    straight.train(progress=False)
    first = _sae_trainer(torch.bfloat16)
    first.train(3, progress=False)
    first.save_checkpoint(tmp_path / "c")
    resumed = Trainer.resume(tmp_path / "c", _source, **({} if dtype is None else {"dtype": dtype}))
    want = dtype or torch.bfloat16
    assert {p.dtype for p in resumed.module.parameters()} == {want}
    masters = first.masters.named(first.module)
    for n, p in resumed.module.named_parameters():
        assert torch.equal(p, masters[n].to(want)), n
    for p, slots in resumed.optimizer.state.items():  # moments in the dtype of what Adam steps (mutant 9)
        assert {v.dtype for k, v in slots.items() if k != "step"} == {p.dtype}
    resumed.train_step()
    if dtype in (None, torch.bfloat16):
        resumed = Trainer.resume(tmp_path / "c", _source)
        _assert_same_trainer(first, resumed)
        resumed.train(progress=False)
        _assert_same_trainer(straight, resumed)


def test_resume_refuses_float16_and_the_meta_device_by_name(base):
    with pytest.raises(ConfigMismatchError, match="float16"):
        Trainer.resume(base, _source, dtype=torch.float16)
    with pytest.raises(PlacementError, match="meta device"):
        Trainer.resume(base, _source, device="meta")


def test_save_refuses_a_non_finite_adam_moment_and_keeps_the_old_checkpoint(base, tmp_path):
    """(Mutation 6: the Adam-state check of ``save_checkpoint`` dropped survived every test.)"""
    from nnsight_lorsa.errors import NonFiniteError

    trainer = Trainer.resume(base, _source)
    trainer.save_checkpoint(tmp_path / "c")
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    p = trainer.masters.held(trainer.module.W_enc)
    trainer.optimizer.state[p]["exp_avg"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="Adam state W_enc.exp_avg hold non-finite"):
        trainer.save_checkpoint(tmp_path / "c")
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == before


def test_a_file_the_manifest_does_not_list_is_not_read(base, tmp_path):
    """(Mutation 4: ``verified_checkpoint``'s required names dropped survived.) ``trainer.json`` present but not in
    the manifest: refused, never read unchecked."""
    shutil.copytree(base, tmp_path / "c")
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    del m["files"]["trainer.json"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"trainer.json: missing checkpoint file \(not listed"):
        Trainer.resume(tmp_path / "c", _source)


# ---------------------------------------------------------------- the sparse-attention trainer's checkpoints
def _sparse_trainer(**config):  # type: ignore[no-untyped-def]
    from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig

    torch.manual_seed(0)
    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    return SparseAttentionTrainer(tiny_hf_model("llama"), stream, SparseTrainConfig(
        **{"total_steps": 3, "batch_size": 2, "seq_len": 16, "target_batches": 1, **config}))


@pytest.fixture(scope="module")
def sparse_base(tmp_path_factory) -> Path:
    trainer = _sparse_trainer()
    trainer.train(steps=2, progress=False)
    d = tmp_path_factory.mktemp("sparse") / "ckpt"
    trainer.save_checkpoint(d)
    return d


SPARSE_TAMPERED = [
    ("moment of another shape", _set("optim.0.exp_avg", torch.zeros(3)), r"optim.0.exp_avg is torch.float32 \(3,\)"),
    ("int moment", _set("optim.0.exp_avg", lambda t: t["optim.0.exp_avg"].to(torch.int32)),
     r"optim.0.exp_avg is torch.int32"),
    ("int parameter", _set("param.lm_head.weight", lambda t: t["param.lm_head.weight"].long()),
     r"param.lm_head.weight is torch.int64"),
    ("NaN parameter", _set("param.lm_head.weight", lambda t: t["param.lm_head.weight"].fill_(float("nan"))),
     r"param.lm_head.weight holds non-finite values"),
    ("parameter of another shape", _set("param.lm_head.weight", torch.zeros(3)), r"param.lm_head.weight is .* \(3,\)"),
    ("RNG state of 3 bytes", _set("rng.global", torch.zeros(3, dtype=torch.uint8)),
     r"rng.global is torch.uint8 \(3,\)"),
    ("unknown tensor", _set("zzz", torch.zeros(2)), r"unknown tensors \['zzz'\]"),
]
SPARSE_META = [
    ("step negative", _set("step", -3), r"key 'step' must be an int >= 0, got -3"),
    ("step fractional", _set("step", 1.5), r"key 'step' must be an int >= 0, got 1.5"),
    ("GECO state missing", lambda m: m.pop("geco"), r"KeyError\('geco'\)"),
    ("GECO ema out of range", lambda m: m["geco"].__setitem__("ema", 7.0), r"GateConfigError"),
    ("config not an object", _set("config", [1]), r"checkpoint.json: key 'config' must be the saved SparseTrainConfig"),
]


@pytest.mark.parametrize(("file", "edit", "match"),
                         [("checkpoint.safetensors", *c[1:]) for c in SPARSE_TAMPERED]
                         + [("checkpoint.json", *c[1:]) for c in SPARSE_META],
                         ids=[c[0] for c in SPARSE_TAMPERED + SPARSE_META])
def test_a_sparse_checkpoint_of_another_kind_is_refused_and_changes_nothing(sparse_base, tmp_path, file, edit, match):
    """Seen failing before the fix: the parameters and RNG states were set before a later entry failed (a
    CheckpointError with the trainer half restored), a moment of another shape loaded and failed at the next step,
    an int parameter or moment, an unknown tensor, a negative or fractional step loaded silently, a bad GECO
    setting raised GateConfigError, not CheckpointError. Now refused, the trainer (weights, Adam state, RNG
    states, GECO, step) as it was."""
    c = edited(sparse_base, tmp_path / "c", file, edit)
    trainer = _sparse_trainer()
    trainer.train(steps=1, progress=False)
    weights = {k: v.clone() for k, v in trainer.hf.state_dict().items()}
    adam = repr(trainer.optimizer.state_dict())
    rng, data, geco, step = torch.get_rng_state(), trainer.gen.get_state(), trainer.geco.state_dict(), trainer.step
    with pytest.raises(CheckpointError, match=match):
        trainer.load_checkpoint(c)
    assert all(torch.equal(v, weights[k]) for k, v in trainer.hf.state_dict().items())
    assert repr(trainer.optimizer.state_dict()) == adam
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(trainer.gen.get_state(), data)
    assert (trainer.geco.state_dict(), trainer.step) == (geco, step)


@pytest.mark.parametrize(("field", "value"), [
    ("init_bias", 2.0), ("target_ce", 4.0), ("gate_lr", 0.1), ("geco_lr", 0.5), ("betas", (0.9, 0.99)), ("seed", 1),
    ("bos_id", 0), ("seq_len", 32), ("temperature", 0.5), ("recover_fraction", 0.5), ("decay_frac", 0.5)])
def test_a_sparse_checkpoint_saved_under_another_config_is_refused(sparse_base, field, value):
    """Seen failing before the fix (each loaded and trained on under the new settings, a run neither config
    describes): a trainer built with another value of one setting refuses the checkpoint naming the setting and both
    values, and stays as it was (weights, Adam state, step)."""
    trainer = _sparse_trainer(**{field: value})
    weights = {k: v.clone() for k, v in trainer.hf.state_dict().items()}
    adam = repr(trainer.optimizer.state_dict())
    with pytest.raises(CheckpointError, match=rf"saved under another SparseTrainConfig: {field}=.* \(this trainer: "):
        trainer.load_checkpoint(sparse_base)
    assert all(torch.equal(v, weights[k]) for k, v in trainer.hf.state_dict().items())
    assert repr(trainer.optimizer.state_dict()) == adam and trainer.step == 0


def test_a_sparse_checkpoint_resumes_into_a_longer_run(sparse_base):
    """``total_steps`` may change (a run extended): the checkpoint loads, its step and history as saved."""
    trainer = _sparse_trainer(total_steps=6, allow_slack_constraint=True)
    trainer.load_checkpoint(sparse_base)
    assert trainer.step == 2 and len(trainer.history) == 2
    trainer.train(steps=1, progress=False)
    assert trainer.step == 3


@functools.cache
def _objective_base(kind: str, root: str) -> Path:
    """A fp64 CLT or Lorsa trainer (:func:`round2_trainer`) checkpointed after 2 steps, under ``root``."""
    trainer, _ = round2_trainer(kind, round2_batches(kind))
    while trainer.step < 2:
        trainer.train_step()
    d = Path(root) / f"objective-{kind}"
    trainer.save_checkpoint(d)
    return d


# (id, kind, edit of trainer.json, what the message must say): the objective's own entries. Before the fix the CLT
# took any list of the right length (a string, zero, NaN or negative scale factor: every later fold and loss wrong
# without a word), and a Lorsa's malformed recipe raised ConfigMismatchError / AttributeError without the file; both
# were read after the trainer's state was set, so restore_state's refusal left that trainer half restored.
OBJECTIVE_TAMPERED = [
    ("CLT scale a string", "clt", _set("s_in_layers", lambda m: ["2", *m["s_in_layers"][1:]]),
     r"trainer.json: key 's_in_layers' must be a list of 2 positive finite numbers .* got \['2'"),
    ("CLT scale zero", "clt", _set("s_out_layers", lambda m: [0.0, *m["s_out_layers"][1:]]),
     r"key 's_out_layers' must be a list of 2 positive finite numbers"),
    ("CLT scale negative", "clt", _set("s_in_layers", lambda m: [-v for v in m["s_in_layers"]]),
     r"key 's_in_layers' must be a list of 2"),
    ("CLT scale NaN", "clt", _set("s_out_layers", lambda m: [float("nan")] * 2),
     r"key 's_out_layers' must be a list of 2"),
    ("CLT scale true", "clt", _set("s_out_layers", lambda m: [True, True]), r"key 's_out_layers' must be a list"),
    ("CLT one layer short", "clt", _set("s_in_layers", lambda m: m["s_in_layers"][:1]),
     r"key 's_in_layers' must be a list of 2"),
    ("CLT scales missing", "clt", lambda m: m.pop("s_out_layers"), r"key 's_out_layers' must be a list of 2 .* None"),
    ("Lorsa recipe of an unknown init", "lorsa", lambda m: m["lorsa_recipe"].__setitem__("ov_init", "bogus"),
     r"trainer.json: key 'lorsa_recipe' is malformed \(LorsaRecipe.ov_init must be one of"),
    ("Lorsa recipe not an object", "lorsa", _set("lorsa_recipe", [1, 2]), r"trainer.json: key 'lorsa_recipe' is "
     r"malformed"),
    ("Lorsa head balance of another size", "lorsa", _set("head_balance", {"log_gain": [0.0], "freq": [0.0]}),
     r"trainer.json: head_balance must hold"),
]


@pytest.mark.parametrize(("kind", "edit", "match"), [c[1:] for c in OBJECTIVE_TAMPERED],
                         ids=[c[0] for c in OBJECTIVE_TAMPERED])
def test_the_objectives_entries_are_checked_before_anything_is_set(tmp_path_factory, tmp_path, kind, edit, match):
    """Seen failing before the fix (the CLT cases resumed silently or with a raw error; the Lorsa recipe raised
    without the file's name; restore_state left the trainer with the checkpoint's step, weights and moments).
    ``Trainer.resume`` refuses the file by name, and ``restore_state`` into a trained trainer refuses it and leaves
    that trainer bit for bit as it was."""
    base_dir = _objective_base(kind, str(tmp_path_factory.getbasetemp()))
    c = edited(base_dir, tmp_path / "c", "trainer.json", edit)
    batches = round2_batches(kind)
    with pytest.raises(CheckpointError, match=match):
        Trainer.resume(c, batches.__getitem__)
    trainer, _ = round2_trainer(kind, batches)
    trainer.train_step()
    before = full_state(trainer)
    recipe = getattr(trainer.objective, "recipe", None)
    with pytest.raises(CheckpointError, match=match):
        trainer.restore_state(c, json.loads((c / "trainer.json").read_text()))
    assert same_state(full_state(trainer), before)
    assert getattr(trainer.objective, "recipe", None) is recipe


@pytest.mark.parametrize("kind", ["clt", "lorsa"])
def test_the_objectives_entries_round_trip(tmp_path_factory, kind):
    """The checked entries are the saved ones: a CLT's per-layer scale factors and a Lorsa's recipe come back
    equal (the fix converts the scale factors to float; JSON keeps them exactly)."""
    base_dir = _objective_base(kind, str(tmp_path_factory.getbasetemp()))
    meta = json.loads((base_dir / "trainer.json").read_text())
    resumed = Trainer.resume(base_dir, round2_batches(kind).__getitem__)
    if kind == "clt":
        assert (resumed.s_in_layers, resumed.s_out_layers) == (meta["s_in_layers"], meta["s_out_layers"])
        assert all(type(v) is float for v in resumed.s_in_layers + resumed.s_out_layers)
    else:
        assert resumed.objective.recipe.to_dict() == meta["lorsa_recipe"]


def test_a_checkpoint_without_the_adam_list_resumes_as_before(base, tmp_path):
    """A checkpoint written before ``adam_params`` existed resumes (the list is optional), and the list a save writes
    names every parameter the optimizer stepped."""
    meta = json.loads((base / "trainer.json").read_text())
    assert meta["adam_params"] == sorted(n for n, _ in _sae_trainer().module.named_parameters())
    old = edited(base, tmp_path / "old", "trainer.json", lambda m: m.pop("adam_params"))
    resumed = Trainer.resume(old, _source)
    _assert_same_trainer(resumed, Trainer.resume(base, _source))
