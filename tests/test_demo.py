"""The main job (`nnsight-lorsa demo`) end to end, on a local model directory and a text file."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import DEVICES, tiny_hf_model, tiny_tokenizer

from nnsight_lorsa.cli import main
from nnsight_lorsa.demo import DemoConfig, run_demo


@pytest.fixture(autouse=True)
def _temporary_directories_in_tmp_path(tmp_path, monkeypatch):
    """A run without --out-dir writes its pictures to a new temporary directory: here, under tmp_path."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_demo_runs_on_a_local_model_dir_and_text_file(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_hf_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    words = [f"w{2 + (i * 7919) % 120}" for i in range(3000)]
    docs = [" ".join(words[i:i + 10 + i % 37]) for i in range(0, 3000, 50)]  # 60 documents, 10-46 words
    text.write_text(" <eos> ".join(docs))  # the tokenizer's EOS text separates them
    out = tmp_path / "out"
    code = main(["demo", "--model", str(model_dir), "--text", str(text), "--steps", "6", "--seq-len", "32",
                 "--batch-size", "4", "--heldout-windows", "8", "--n-show", "2", "--out-dir", str(out),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "corpus: 60 windows x 32 tokens (one per document, from its start)" in printed
    for needle in ("FVU", "L0", "dead heads", "CE orig", "CE lorsa", "CE zero-ablated", "lorsa.replace(layer=1)",
                   "z-pattern"):
        assert needle in printed
    result = json.loads((out / "demo_results.json").read_text())
    assert result["layer"] == 1 and result["config"]["n_ov_heads"] == 8 * 64
    assert result["eval"]["fvu"] >= 0 and result["eval"]["l0"] <= 16
    assert (out / "lorsa" / "layer_1" / "model.safetensors").is_file()


def test_demo_rejects_a_layer_out_of_range(tmp_path, capsys):
    from nnsight_lorsa.errors import LayerOutOfRangeError

    model_dir = tmp_path / "model"
    tiny_hf_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"w{i % 100 + 2}" for i in range(500)))  # one document: consecutive windows
    with pytest.raises(LayerOutOfRangeError):
        run_demo(DemoConfig(model_dir=str(model_dir), text_path=str(text), layer=9, progress=False))
    assert main(["demo", "--model", str(model_dir), "--text", str(text), "--layer", "9", "--no-progress"]) == 1
    assert "LayerOutOfRangeError" in capsys.readouterr().err


# --------------------------------------------------------------------------- arguments checked before any work
@pytest.fixture
def local_model(tmp_path):
    model_dir = tmp_path / "model"
    tiny_hf_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"w{i % 100 + 2}" for i in range(800)))  # one document: consecutive windows
    return ["--model", str(model_dir), "--text", str(text), "--no-progress"]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the demo loads a model or builds a Lorsa."""
    import nnsight_lorsa.demo
    from nnsight_lorsa.modules.lorsa import Lorsa

    def fail(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(nnsight_lorsa.demo, "load_model", fail)
    monkeypatch.setattr(Lorsa, "__init__", fail)


@pytest.mark.parametrize(("args", "flag"), [
    (["--seq-len", "1"], "--seq-len"), (["--seq-len", "0"], "--seq-len"), (["--batch-size", "0"], "--batch-size"),
    (["--steps", "0"], "--steps"), (["--steps", "-5"], "--steps"), (["--top-k", "0"], "--top-k"),
    (["--n-ov-heads", "0"], "--n-ov-heads"), (["--layer", "-1"], "--layer"), (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"), (["--heldout-windows", "0"], "--heldout-windows"), (["--n-show", "-1"], "--n-show"),
    (["--qk-heads-per-mhsa-head", "0"], "--qk-heads-per-mhsa-head"), (["--model", "/nonexistent/dir"], "--model"),
    (["--text", "/nonexistent/file.txt"], "--text"), (["--dtype", "int8"], "--dtype"),
    (["--device", "tpu"], "--device"), (["--threads", "0"], "--threads"),
    (["--resume", "/nonexistent"], "--resume"), (["--device", "nonsense:x"], "--device"),
    *([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device")]),
])
def test_bad_arguments_exit_2_before_any_work(args, flag, no_work, capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", *args, "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


@pytest.mark.parametrize("device", ["cuda:7", "cuda:1"])
def test_a_gpu_index_this_machine_lacks_exits_2_before_any_work(device, no_work, monkeypatch, capsys):
    """``--device cuda:7`` where torch sees CUDA but no 8th GPU (here: CUDA reported, no GPU usable) passed the
    demo's own device check (``device.type == "cuda"`` and ``torch.cuda.is_available()``) and failed in the model
    load; it is refused with the arguments, by the package's one device check (``_placement.check_device_arg``)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as info:
        main(["demo", "--device", device, "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--device" in err and device in err and "Traceback" not in err


def test_an_unwritable_out_dir_is_refused_before_any_work(tmp_path, no_work, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as info:
        main(["demo", "--out-dir", str(blocker / "out"), "--no-progress"])
    assert info.value.code == 2 and "--out-dir" in capsys.readouterr().err
    ok = tmp_path / "new" / "out"
    from nnsight_lorsa.demo import _check_out_dir

    _check_out_dir(str(ok))  # created, probed, left empty
    assert ok.is_dir() and not any(ok.iterdir())


@pytest.mark.parametrize(("args", "needle"), [
    (["--n-ov-heads", str(10**12)], "GiB"),                     # ~PB of weights: refused from the memory bound
    (["--seq-len", str(10**7), "--batch-size", "64"], "GiB"),    # QK patterns of 10^7 x 10^7
    (["--n-ov-heads", "100"], "multiple"),                      # 100 OV heads over 16 QK heads
])
def test_sizes_that_do_not_fit_are_refused_before_the_lorsa_exists(local_model, args, needle, monkeypatch, capsys):
    from nnsight_lorsa.modules.lorsa import Lorsa

    def fail(*a, **k):
        raise AssertionError("the Lorsa was allocated")

    monkeypatch.setattr(Lorsa, "__init__", fail)
    with pytest.raises(SystemExit) as info:
        main(["demo", *local_model, *args])
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_the_memory_bound_comes_from_the_machine_not_the_model():
    from nnsight_lorsa.demo import _memory_bytes, _training_bytes

    have = _memory_bytes()
    assert have is not None and have > 2**28
    # a Llama-3-8B-sized Lorsa (d_model 4096, 8 x 4096 OV heads) needs GiBs, far above the tiny model's
    assert _training_bytes(4096, 128, 128, 8 * 4096, 16, 256) > 2**30


def test_a_failure_in_evaluation_keeps_the_trained_lorsa(local_model, tmp_path, monkeypatch):
    import importlib

    training = importlib.import_module("nnsight_lorsa.training")

    def broken(*a, **k):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(training, "evaluate", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="evaluation failed"):
        main(["demo", *local_model, "--steps", "2", "--seq-len", "16", "--batch-size", "4", "--out-dir", str(out)])
    assert (out / "lorsa" / "layer_1" / "model.safetensors").is_file()
    saved = json.loads((out / "demo_results.json").read_text())
    assert saved["steps"] == 2 and "eval" not in saved


def test_the_installed_command_exits_2_with_a_message(tmp_path):
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "nnsight_lorsa.cli", "demo", "--batch-size", "0"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 2 and "--batch-size must be a positive integer" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_demo_runs_with_a_low_precision_model(local_model, tmp_path, device, dtype, capsys):
    """``--device`` / ``--dtype``: the model in bf16 / fp16 on the device, the Lorsa trained in fp32 beside it;
    the held-out numbers are finite and the trained Lorsa is saved in fp32."""
    out = tmp_path / "out"
    code = main(["demo", *local_model, "--steps", "4", "--seq-len", "16", "--batch-size", "4",
                 "--heldout-windows", "4", "--n-show", "1", "--device", device, "--dtype", dtype,
                 "--out-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    ev = json.loads((out / "demo_results.json").read_text())["eval"]
    assert all(ev[k] == ev[k] and abs(ev[k]) < 1e6 for k in ("fvu", "l0", "ce_orig", "ce_spliced")), ev
    from nnsight_lorsa import load

    assert load(out / "lorsa" / "layer_1").W_O.dtype == torch.float32


# --------------------------------------------------------------------------- training guards (issue 23)
def test_a_diverging_lr_exits_1_with_a_one_line_message(local_model, capsys):
    """``--lr 1e30`` is a finite positive number (accepted); training overflows at once and the run stops with
    NonFiniteError naming the step and the tensor, status 1, one line, no traceback (it printed NaN metrics
    and exited 0 before)."""
    code = main(["demo", *local_model, "--lr", "1e30", "--steps", "20", "--seq-len", "16", "--batch-size", "4"])
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.startswith("nnsight-lorsa demo: error:")]
    assert len(lines) == 1 and "NonFiniteError: step " in lines[0] and "Traceback" not in err, err
    assert "the loss is nan" in lines[0] or "the gradient norm is" in lines[0], err


def test_too_few_tokens_for_the_lorsa_init_exits_1_saying_what_to_raise(capsys):
    """``nnsight-lorsa demo --batch-size 2 --seq-len 16`` (embedded model, d_qk_head 32): 2 x 15 counted tokens
    in the first batch; the named error says to raise --batch-size or --seq-len (a raw shape error before)."""
    code = main(["demo", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert ("TooFewTokensError: the Lorsa recipe's OV initialisation (ov_init='value_svd') needs at least "
            "d_qk_head=32 counted tokens in the first batch; it has 30" in err), err
    lines = [line for line in err.splitlines() if line.startswith("nnsight-lorsa demo: error:")]
    assert len(lines) == 1 and "raise --batch-size or --seq-len" in lines[0] and "Traceback" not in err, err


def test_a_text_that_is_not_utf8_or_a_directory_that_is_no_model_exit_2_before_any_work(tmp_path, no_work, capsys):
    """Were a ``UnicodeDecodeError`` / transformers traceback; now argparse's usage error naming the input."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    empty_model = tmp_path / "not_a_model"
    empty_model.mkdir()
    (empty_model / "config.json").write_text("{}")
    for args, needle in ((["--text", str(latin)], "not UTF-8 text (byte 3"),
                         (["--model", str(empty_model)], "no weights")):
        with pytest.raises(SystemExit) as info:
            main(["demo", *args, "--no-progress"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- issue 25: help, labels, threads, Ctrl-C
def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_has_a_line_and_a_default_for_every_option_and_no_sphinx_markup(capsys):
    from nnsight_lorsa.cli import _parser

    top = _help(["--help"], capsys)
    assert "nnsight-lorsa demo" in top and "130" in top
    for markup in ("``", ":func:", ":class:", ":meth:", ":mod:"):
        assert markup not in top, top
    text = _help(["demo", "--help"], capsys)
    assert "``" not in text and ":func:" not in text
    _, demo = _parser()
    options = [a for a in demo._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} >= {"model_dir", "text_path", "layer", "seq_len", "steps", "lr", "threads",
                                         "resume", "progress"}
    for action in options:
        assert action.help and "(default: " in action.help, action.option_strings
    for flag, default in (("--seq-len", "128"), ("--batch-size", "16"), ("--steps", "1500"), ("--lr", "0.004"),
                          ("--dtype", "float32"), ("--device", "cpu")):
        block = text[text.index("\n  " + flag + " "):]
        block = " ".join(block[:block.index("\n  --", 1)].split())
        assert f"(default: {default})" in block, block
    assert "busy" in " ".join(text.split())  # --threads says when to lower it


@pytest.mark.parametrize(("family", "label"), [("qwen2", "qwen2, llama adapter"), ("qwen3", "qwen3, llama adapter"),
                                             ("llama", "llama"), ("gpt2", "gpt2"), ("neox", "gpt_neox")])
def test_the_printout_names_the_models_own_type_and_the_adapter_where_it_differs(family, label):
    """Qwen2 / Mistral models were printed as ``llama`` (the adapter family); now ``qwen2, llama adapter``."""
    from helpers import tiny_config

    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.demo import _model_kind

    config = tiny_config(family)
    assert _model_kind(config, get_adapter(config)) == label
    mistral = __import__("transformers").MistralConfig()
    assert _model_kind(mistral, get_adapter(mistral)) == "mistral, llama adapter"


def test_the_demo_prints_the_models_type(local_model, capsys):
    code = main(["demo", *local_model, "--steps", "1", "--seq-len", "16", "--batch-size", "4",
                 "--heldout-windows", "4", "--n-show", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "(llama, 3 layers, d_model 64)" in out, out


def test_threads_sets_torchs_thread_count(local_model, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    import nnsight_lorsa.demo

    def stop(*a, **k):
        raise RuntimeError("stop after the settings")

    monkeypatch.setattr(nnsight_lorsa.demo, "load_model", stop)
    with pytest.raises(RuntimeError, match="stop after"):
        main(["demo", *local_model, "--threads", "1"])
    assert calls == [1]
    calls.clear()
    with pytest.raises(RuntimeError, match="stop after"):
        main(["demo", *local_model])
    assert calls == []  # the default leaves torch's own


def _interrupt_at(monkeypatch, k: int) -> None:
    from nnsight_lorsa.training import Trainer

    step = Trainer.train_step

    def interrupted(self):
        if self.step == k:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted)


def test_ctrl_c_in_training_keeps_a_checkpoint_exits_130_and_the_printed_command_resumes(
        local_model, tmp_path, monkeypatch, capsys):
    import shlex

    from nnsight_lorsa import load
    from nnsight_lorsa.training import Trainer

    out = tmp_path / "out"
    args = ["demo", *local_model, "--steps", "6", "--seq-len", "16", "--batch-size", "4", "--heldout-windows", "4",
            "--n-show", "1", "--out-dir", str(out)]
    with monkeypatch.context() as m:
        _interrupt_at(m, 3)
        code = main(args)
    err = capsys.readouterr().err
    assert code == 130, err
    assert "Traceback" not in err and "interrupted after step 3" in err, err
    assert (out / "checkpoint" / "trainer.json").is_file()
    assert Trainer.load_checkpoint(out / "checkpoint")[0]["step"] == 3
    assert load(out / "lorsa_interrupted" / "layer_1").W_O.dtype == torch.float32
    assert not (out / "demo_results.json").exists()  # no evaluation of an unfinished training
    line = next(line for line in err.splitlines() if line.startswith("resume with: "))
    command = shlex.split(line.removeprefix("resume with: "))
    assert command[:2] == ["nnsight-lorsa", "demo"] and command[-2:] == ["--resume", str(out / "checkpoint")]
    assert main(command[1:]) == 0  # the printed command finishes the run
    printed = capsys.readouterr().out
    assert "resuming from" in printed and "at step 3 of 6" in printed
    result = json.loads((out / "demo_results.json").read_text())
    assert result["steps"] == 6 and result["train_history"][-1]["step"] == 6
    # the finished run's Lorsa replaces the interrupted one: no stale lorsa_interrupted/ beside lorsa/ (was kept)
    assert load(out / "lorsa" / "layer_1").W_O.dtype == torch.float32
    assert not (out / "lorsa_interrupted").exists()


def test_ctrl_c_without_out_dir_saves_to_a_temporary_directory(local_model, tmp_path, monkeypatch, capsys):
    import tempfile

    made = tmp_path / "tmp-made"
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **k: (made.mkdir(), str(made))[1])
    _interrupt_at(monkeypatch, 2)
    assert main(["demo", *local_model, "--steps", "5", "--seq-len", "16", "--batch-size", "4"]) == 130
    err = capsys.readouterr().err
    assert str(made / "checkpoint") in err and (made / "checkpoint" / "trainer.json").is_file(), err
    _interrupt_at(monkeypatch, 0)  # before the first step: nothing to keep, said
    assert main(["demo", *local_model, "--steps", "5", "--seq-len", "16", "--batch-size", "4"]) == 130
    assert "nothing trained" in capsys.readouterr().err


def test_resuming_with_other_lorsa_arguments_is_refused(local_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _interrupt_at(m, 1)
        assert main(["demo", *local_model, "--steps", "3", "--seq-len", "16", "--batch-size", "4",
                     "--out-dir", str(out)]) == 130
    code = main(["demo", *local_model, "--steps", "3", "--seq-len", "16", "--batch-size", "4", "--top-k", "8",
                 "--resume", str(out / "checkpoint")])
    assert code == 1 and "CheckpointError" in capsys.readouterr().err


# --------------------------------------------------------------------------- token ids (issue 24)
def test_demo_runs_on_token_ids_with_a_model_without_tokenizer(tmp_path, capsys):
    """``--tokens FILE``: a model directory with no tokenizer files trains on a token-id stream cut at the
    config's EOS id, one window per document, and shows its heads with id tokens."""
    model_dir = tmp_path / "model"
    hf = tiny_hf_model("llama")
    hf.config.bos_token_id, hf.config.eos_token_id = 0, 1
    hf.save_pretrained(model_dir)
    assert not any(p.name.startswith("tokenizer") for p in model_dir.iterdir())
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, 100, (int(n),), generator=gen).tolist() + [1]
            for n in torch.randint(8, 40, (60,), generator=gen)]
    from safetensors.torch import save_file

    save_file({"input_ids": torch.tensor([t for d in docs for t in d])}, str(tmp_path / "ids.safetensors"))
    out = tmp_path / "out"
    code = main(["demo", "--model", str(model_dir), "--tokens", str(tmp_path / "ids.safetensors"), "--steps", "4",
                 "--seq-len", "32", "--batch-size", "4", "--heldout-windows", "8", "--n-show", "1",
                 "--out-dir", str(out), "--no-progress"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert f"token ids from {tmp_path / 'ids.safetensors'}: 60 windows x 32 tokens" in printed.out
    assert json.loads((out / "demo_results.json").read_text())["eval"]["fvu"] >= 0


def test_text_and_tokens_together_are_refused(tmp_path, no_work, capsys):
    (tmp_path / "t.txt").write_text("w2 w3")
    np_path = tmp_path / "ids.npy"
    import numpy as np

    np.save(np_path, np.arange(2, 40))
    with pytest.raises(SystemExit) as info:
        main(["demo", "--text", str(tmp_path / "t.txt"), "--tokens", str(np_path), "--no-progress"])
    assert info.value.code == 2 and "--text and --tokens" in capsys.readouterr().err
    (tmp_path / "ids.npy").write_bytes(b"not numpy")
    with pytest.raises(SystemExit) as info:
        main(["demo", "--tokens", str(np_path), "--no-progress"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and str(np_path) in err and "Traceback" not in err


# --------------------------------------------------------------------------- generated argument sets (issue 23)
_FLAGS = ["--seq-len", "--batch-size", "--steps", "--n-ov-heads", "--qk-heads-per-mhsa-head", "--top-k", "--lr",
          "--heldout-windows", "--n-show", "--seed", "--layer", "--threads", "--device", "--dtype", "--model",
          "--text", "--tokens", "--resume", "--out-dir"]


def _values():
    from hypothesis import strategies as st

    return st.one_of(st.integers(-3, 5).map(str), st.sampled_from(
        ["0", "1e30", "-1e-3", "nan", "inf", "2.5", "", "cpu", "cuda", "auto", "meta", "float32", "int8", "x",
         "/nonexistent", "True", "--steps", "1_000", "0x10", " 3", "é"]))


def _argv_sets():
    from hypothesis import strategies as st

    return st.lists(st.tuples(st.sampled_from(_FLAGS), _values()), max_size=5)


def test_generated_argument_sets_end_in_a_run_or_a_usage_error(monkeypatch, tmp_path):
    """Any argument set either passes every check (the run is then stubbed right after them) or exits 2 with a
    one-line usage error naming an option — never a traceback or a raw exception."""
    from hypothesis import given, settings

    import nnsight_lorsa.demo as demo

    class Checked(Exception):
        pass

    def stop(*a, **k):
        raise Checked

    monkeypatch.setattr(demo, "load_model", stop)
    monkeypatch.setattr(demo, "_check_out_dir", lambda d: None)  # no directories made under the cwd

    @settings(max_examples=150, deadline=None)
    @given(_argv_sets())
    def run(pairs):
        argv = ["demo", "--no-progress", *[x for pair in pairs for x in pair]]
        try:
            main(argv)
        except Checked:  # every check passed: the run would start here
            return
        except SystemExit as e:
            assert e.code == 2, (argv, e.code)
            return
        raise AssertionError(f"{argv} neither ran nor was refused")

    run()


# --------------------------------------------------------------------------- issue 25: the main job ends with pictures
@pytest.mark.slow  # ~55 s on a busy 2-core machine (the embedded corpus, its transcoders in the graph)
def test_the_demo_writes_its_pictures_and_the_graph_shows_logits_and_lorsa_heads_at_first_paint(tmp_path, capsys):
    """The embedded model, 40 steps (2 left the Lorsa too weak for the pruned graph to keep a head once the init's
    signs changed, ddaa0e1: a slow-only failure): the run prints the paths of the training curves, the top heads'
    dashboards, the attribution graph (viewer) and its circuit-tracer JSON; in headless Chromium the graph's first
    paint shows every logit and Lorsa heads, and each dashboard its contexts and legend (no U+FFFD: the logit lens
    names byte tokens by their bytes)."""
    from pathlib import Path

    from helpers import first_paint, render_dom, require_chromium

    from nnsight_lorsa.demo import PROMPT

    out = tmp_path / "out"
    code = main(["demo", "--steps", "40", "--seq-len", "64", "--batch-size", "8", "--heldout-windows", "8",
                 "--n-show", "2", "--out-dir", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    pics = json.loads((out / "demo_results.json").read_text())["pictures"]
    assert pics["training_curves"] == str(out / "training_curves.png")
    assert pics["graph_html"] == str(out / "graph.html") and pics["graph_json"] == str(out / "graph.json")
    assert len(pics["dashboards"]) == 2
    for path in [pics["training_curves"], pics["graph_html"], pics["graph_json"], *pics["dashboards"]]:
        assert path in printed and Path(path).is_file(), path
    assert Path(pics["training_curves"]).read_bytes()[:4] == b"\x89PNG"
    graph = json.loads(Path(pics["graph_json"]).read_text())
    kinds = {n["feature_type"] for n in graph["nodes"]}
    assert {"lorsa", "logit", "embedding", "cross layer transcoder"} <= kinds  # embedded: its transcoders too
    assert graph["metadata"]["prompt"] == PROMPT
    require_chromium()
    seen = first_paint(Path(pics["graph_html"]), tmp_path, size=(1400, 900))
    assert seen["logit"][0] == seen["logit"][1] > 0 and seen["lorsa"][0] >= 1, seen
    for page in pics["dashboards"]:
        dom = render_dom(Path(page))
        assert 'data-rendered="yes"' in dom and 'id="legend"' in dom and "\ufffd" not in dom
        assert dom.count('class="ctx"') >= 1


def test_pictures_go_to_a_temporary_directory_without_out_dir_and_no_pictures_writes_none(local_model, tmp_path,
                                                                                          capsys):
    """A local model directory (no shipped transcoders: the graph holds the Lorsa's heads and error nodes); the
    graph's first paint in headless Chromium shows every logit and Lorsa heads, the dashboard its contexts."""
    from pathlib import Path

    args = ["demo", *local_model, "--steps", "2", "--seq-len", "16", "--batch-size", "4", "--heldout-windows", "4",
            "--n-show", "1"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    made = sorted(tmp_path.glob("nnsight-lorsa-demo-*"))
    assert len(made) == 1 and f"in {made[0]}:" in printed
    names = {p.relative_to(made[0]).as_posix() for p in made[0].rglob("*") if p.is_file()}
    assert {"training_curves.png", "graph.html", "graph.json"} <= names
    assert sum(n.startswith("dashboards/L1_H") for n in names) == 1
    graph = json.loads((made[0] / "graph.json").read_text())
    assert "logit" in {n["feature_type"] for n in graph["nodes"]}
    from helpers import first_paint, render_dom, require_chromium

    require_chromium()
    seen = first_paint(made[0] / "graph.html", tmp_path, size=(1400, 900))
    assert seen["logit"][0] == seen["logit"][1] > 0 and seen["lorsa"][0] >= 1, seen
    page = next((made[0] / "dashboards").iterdir())
    dom = render_dom(page)
    assert 'data-rendered="yes"' in dom and 'id="legend"' in dom and dom.count('class="ctx"') >= 1
    assert main([*args, "--no-pictures", "--out-dir", str(tmp_path / "plain")]) == 0
    assert "\npictures (" not in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["demo_results.json", "lorsa"]
    assert len(list(tmp_path.glob("nnsight-lorsa-demo-*"))) == 1
    assert Path(made[0]).is_dir()
