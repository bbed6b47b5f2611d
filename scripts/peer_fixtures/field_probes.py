"""Per-field config probes, judged by the peer itself (run in a PEER's venv, never nnsight-lorsa)::

    V/bin/python scripts/peer_fixtures/field_probes.py saelens OUT_DIR    # V: sae-lens 6.54.x
    V/bin/python scripts/peer_fixtures/field_probes.py sparsify OUT_DIR   # V: eai-sparsify 1.3.3

Each case starts from a tiny coder the peer's own code saved, then changes ONE ``cfg.json`` field
(or one tensor of the weights file) to a value the peer's config allows or a file could carry. The
peer then loads the case with its own loader and runs it on fixed inputs:

* ``verdict.json``: ``{"field", "value", "peer": "ok" | "error", "error": <the peer's exception>,
  "x_shape"}``;
* ``reference.safetensors`` (``peer == "ok"``): ``x`` and the peer's ``feature_acts`` (dense),
  ``sae_out``, ``l0``;
* ``base.safetensors`` (``peer == "error"``, and ``unknown_key``): the same for the unchanged coder.

``combo_NN`` cases: seeded draws of the math-changing fields together (architecture or activation, ``k``,
centring, normalisation, decoder-norm rescaling, hook_z, dtype; transcode, skip, multi_topk, latent count),
each coder built and saved by the peer itself.

``tests/formats/test_field_probes.py`` holds our loader to: a case the peer runs loads and matches
the peer's numbers, or raises a named error of ours; a case the peer refuses raises a named error.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fixed_inputs, fresh_output_dir, randomize_, save_reference  # noqa: E402

D_IN, D_SAE, K = 8, 16, 3
N_COMBOS = 24

Mutation = Callable[[dict[str, Any], dict[str, torch.Tensor]], None]


def _set(key: str, value: Any, meta: bool = False) -> Mutation:
    def f(cfg: dict[str, Any], _: dict[str, torch.Tensor]) -> None:
        target = cfg.setdefault("metadata", {}) if meta else cfg
        target[key] = value
    return f


def _drop(key: str) -> Mutation:
    def f(cfg: dict[str, Any], _: dict[str, torch.Tensor]) -> None:
        cfg.pop(key, None)
    return f


def _tensor(name: str, value: Callable[[dict[str, torch.Tensor]], torch.Tensor | None]) -> Mutation:
    def f(_: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        t = value(state)
        if t is None:
            state.pop(name, None)
        else:
            state[name] = t
    return f


def _both(*fs: Mutation) -> Mutation:
    def f(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        for g in fs:
            g(cfg, state)
    return f


def _judge(case: Path, verdict: dict[str, Any], run: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """``verdict`` with the peer's judgement of ``case``: ``peer="ok"`` and its outputs saved beside the case
    (``save_reference``), or ``peer="error"`` and the peer's refusal."""
    try:
        ref = run(case)
    except Exception as e:  # noqa: BLE001 - the peer's refusal is the verdict
        verdict.update(peer="error", error=f"{type(e).__name__}: {e}"[:300])
    else:
        verdict.update(peer="ok", x_shape=list(ref["x"].shape))
        save_reference(case, **ref)
    return verdict


def _write_case(out: Path, name: str, base: Path, cfg_file: str, weights_file: str, field: str, value: Any,
                mutate: Mutation, run: Callable[[Path], dict[str, torch.Tensor]]) -> None:
    case = out / name
    shutil.copytree(base, case)
    base_ref = run(case)  # the peer on the unchanged base: what a lenient reader of the change must give
    cfg = json.loads((case / cfg_file).read_text())
    state = load_file(str(case / weights_file))
    mutate(cfg, state)
    (case / cfg_file).write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(case / weights_file))
    verdict = _judge(case, {"field": field, "value": value}, run)
    if verdict["peer"] == "error" or name == "unknown_key":  # what a lenient read must give (kept small)
        save_file({k: v.contiguous() for k, v in base_ref.items()}, str(case / "base.safetensors"))
    (case / "verdict.json").write_text(json.dumps(verdict, indent=1, default=str))
    print(name, verdict["peer"], verdict.get("error", ""))


# ------------------------------------------------------------------ SAELens
def saelens(out: Path) -> None:
    from sae_lens import SAE
    from sae_lens.registry import get_sae_class

    bases = out / "_bases"
    hook = "blocks.1.hook_resid_post"
    for arch, extra in (("standard", {}), ("topk", {"k": K}), ("jumprelu", {}), ("transcoder", {"d_out": 6}),
                        ("standard_z", {})):
        cls, cfg_cls = get_sae_class(arch.removesuffix("_z"))
        kw = {"apply_b_dec_to_input": False} if arch == "transcoder" else {}
        sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **extra, **kw))
        sae.cfg.metadata.hook_name = "blocks.1.attn.hook_z" if arch.endswith("_z") else hook
        if arch.endswith("_z"):
            sae.cfg.reshape_activations = "hook_z"
        randomize_(sae, seed=len(arch))
        if hasattr(sae, "threshold"):
            with torch.no_grad():
                sae.threshold.abs_().mul_(0.5)
        sae.save_model(bases / arch)

    def run(case: Path) -> dict[str, torch.Tensor]:
        sae = SAE.load_from_disk(case)
        sae.eval()
        x = fixed_inputs(D_IN).to(sae.dtype)  # its skip path does not cast x (a float64 skip transcoder fails)
        if sae.cfg.reshape_activations == "hook_z":
            x = x.reshape(8, 2, D_IN // 2)
        with torch.no_grad():
            acts = sae.encode(x)
            y = sae(x)
        return {"x": x, "feature_acts": acts, "sae_out": y, "l0": (acts != 0).sum(-1)}

    w = "sae_weights.safetensors"
    cases: list[tuple[str, str, str, Any, Mutation]] = [
        # (case, base, field, value, mutation)
        ("dtype_float32", "standard", "dtype", "float32", _set("dtype", "float32")),
        ("dtype_float64", "standard", "dtype", "float64", _set("dtype", "float64")),
        ("dtype_bfloat16", "standard", "dtype", "bfloat16", _set("dtype", "bfloat16")),
        ("dtype_torch_float16", "standard", "dtype", "torch.float16", _set("dtype", "torch.float16")),
        ("dtype_bogus", "standard", "dtype", "fp8e9", _set("dtype", "fp8e9")),
        ("device_cpu", "standard", "device", "cpu", _set("device", "cpu")),
        ("apply_b_dec_false", "standard", "apply_b_dec_to_input", False, _set("apply_b_dec_to_input", False)),
        ("apply_b_dec_absent", "standard", "apply_b_dec_to_input", None, _drop("apply_b_dec_to_input")),
        ("apply_b_dec_transcoder", "transcoder", "apply_b_dec_to_input", True,
         _set("apply_b_dec_to_input", True)),
        ("normalize_null", "standard", "normalize_activations", None, _set("normalize_activations", None)),
        ("normalize_bogus", "standard", "normalize_activations", "batch_norm",
         _set("normalize_activations", "batch_norm")),
        ("normalize_constant_norm_rescale", "standard", "normalize_activations", "constant_norm_rescale",
         _set("normalize_activations", "constant_norm_rescale")),
        ("normalize_layer_norm_jumprelu", "jumprelu", "normalize_activations", "layer_norm",
         _set("normalize_activations", "layer_norm")),
        ("normalize_layer_norm_transcoder", "transcoder", "normalize_activations", "layer_norm",
         _set("normalize_activations", "layer_norm")),
        ("reshape_hook_z", "standard_z", "reshape_activations", "hook_z", _set("reshape_activations", "hook_z")),
        ("reshape_hook_z_resid_hook", "standard", "reshape_activations", "hook_z",
         _set("reshape_activations", "hook_z")),
        ("reshape_bogus", "standard", "reshape_activations", "hook_q", _set("reshape_activations", "hook_q")),
        ("hook_head_index_z", "standard_z", "metadata.hook_head_index", 1, _set("hook_head_index", 1, meta=True)),
        ("hook_head_index_resid", "standard", "metadata.hook_head_index", 1,
         _set("hook_head_index", 1, meta=True)),
        ("hook_name_unmapped", "standard", "metadata.hook_name", "blocks.1.attn.hook_pattern",
         _set("hook_name", "blocks.1.attn.hook_pattern", meta=True)),
        ("metadata_absent", "standard", "metadata", None, _drop("metadata")),
        ("metadata_extra", "standard", "metadata.prepend_bos", False, _set("prepend_bos", False, meta=True)),
        ("d_in_mismatch", "standard", "d_in", D_IN + 1, _set("d_in", D_IN + 1)),
        ("d_sae_mismatch", "standard", "d_sae", D_SAE - 1, _set("d_sae", D_SAE - 1)),
        ("d_out_mismatch", "transcoder", "d_out", 7, _set("d_out", 7)),
        ("missing_b_dec", "standard", "tensor b_dec", None, _tensor("b_dec", lambda s: None)),
        ("missing_threshold", "jumprelu", "tensor threshold", None, _tensor("threshold", lambda s: None)),
        ("extra_threshold_standard", "standard", "tensor threshold", "extra",
         _tensor("threshold", lambda s: torch.full((D_SAE,), 0.2))),
        ("extra_W_skip_standard", "standard", "tensor W_skip", "extra",
         _tensor("W_skip", lambda s: torch.zeros(D_IN, D_IN))),
        ("rescale_standard", "standard", "rescale_acts_by_decoder_norm", True,
         _set("rescale_acts_by_decoder_norm", True)),
        ("rescale_jumprelu", "jumprelu", "rescale_acts_by_decoder_norm", True,
         _set("rescale_acts_by_decoder_norm", True)),
        ("rescale_topk", "topk", "rescale_acts_by_decoder_norm", True, _set("rescale_acts_by_decoder_norm", True)),
        ("rescale_topk_absent", "topk", "rescale_acts_by_decoder_norm", None, _drop("rescale_acts_by_decoder_norm")),
        ("k_1", "topk", "k", 1, _set("k", 1)),
        ("k_d_sae", "topk", "k", D_SAE, _set("k", D_SAE)),
        ("k_too_big", "topk", "k", D_SAE + 1, _set("k", D_SAE + 1)),
        ("k_zero", "topk", "k", 0, _set("k", 0)),
        ("k_float", "topk", "k", 2.5, _set("k", 2.5)),
        ("k_absent", "topk", "k", None, _drop("k")),
        ("k_on_standard", "standard", "k", K, _set("k", K)),
        ("decoder_init_norm", "standard", "decoder_init_norm", 0.5, _set("decoder_init_norm", 0.5)),
        ("unknown_key", "standard", "some_future_key", 1, _set("some_future_key", 1)),
    ]
    for name, base, field, value, mutate in cases:
        _write_case(out, name, bases / base, "cfg.json", w, field, value, mutate, run)
    shutil.rmtree(bases)

    # drawn combinations of the math-changing fields, each coder built and saved by SAELens itself
    rng = random.Random(1)
    for i in range(N_COMBOS):
        arch = rng.choice(["standard", "topk", "abstopk", "jumprelu", "gated", "transcoder", "skip_transcoder",
                           "jumprelu_transcoder", "jumprelu_skip_transcoder"])
        kw: dict[str, Any] = {"normalize_activations": rng.choice(["none", "constant_norm_rescale", "layer_norm"]),
                              "dtype": rng.choice(["float32", "float64"])}
        hook_z = False
        if "transcoder" in arch:
            kw.update(apply_b_dec_to_input=False, d_out=rng.randint(1, 12))
        else:
            kw["apply_b_dec_to_input"] = rng.random() < 0.5
            hook_z = rng.random() < 0.3
            if hook_z:
                kw["reshape_activations"] = "hook_z"
        if "topk" in arch:
            kw.update(k=rng.randint(1, D_SAE), rescale_acts_by_decoder_norm=rng.random() < 0.5)
        _combo_case(out, f"combo_{i:02d}", {"architecture": arch, **kw},
                    lambda d, arch=arch, kw=kw, hook_z=hook_z: _saelens_save(d, arch, kw, hook_z), run)


def _saelens_save(case: Path, arch: str, kw: dict[str, Any], hook_z: bool) -> None:
    from sae_lens.registry import get_sae_class

    cls, cfg_cls = get_sae_class(arch)
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **kw))
    sae.cfg.metadata.hook_name = "blocks.1.attn.hook_z" if hook_z else "blocks.1.hook_resid_post"
    randomize_(sae, seed=100 + int(case.name[-2:]))
    if hasattr(sae, "threshold"):
        with torch.no_grad():
            sae.threshold.abs_().mul_(0.5)
    sae.save_model(case)


def _combo_case(out: Path, name: str, value: dict[str, Any], save: Callable[[Path], None],
                run: Callable[[Path], dict[str, torch.Tensor]]) -> None:
    case = out / name
    save(case)
    verdict = _judge(case, {"field": "combination", "value": value}, run)
    (case / "verdict.json").write_text(json.dumps(verdict, indent=1, default=str))
    print(name, value, verdict["peer"], verdict.get("error", ""))


# ------------------------------------------------------------------ sparsify
def sparsify(out: Path) -> None:
    here = str(Path(__file__).resolve().parent)  # its sparsify.py would shadow the peer package
    sys.path[:] = [p for p in sys.path if p not in (here, "")]
    sys.modules.pop("sparsify", None)
    from sparsify import SparseCoder, SparseCoderConfig

    bases = out / "_bases"
    for name, kw in (("sae", {}), ("transcoder", {"transcode": True}), ("skip", {"skip_connection": True})):
        coder = SparseCoder(D_IN, SparseCoderConfig(num_latents=D_SAE, k=K, **kw))
        randomize_(coder, seed=len(name))
        coder.save_to_disk(bases / name / "layers.1")

    def run(case: Path) -> dict[str, torch.Tensor]:
        coder = SparseCoder.load_from_disk(case)
        x = fixed_inputs(coder.d_in)
        with torch.no_grad():
            enc = coder.encode(x)
            acts = torch.zeros_like(enc.pre_acts).scatter_(-1, enc.top_indices, enc.top_acts)
            y = coder.decode(enc.top_acts, enc.top_indices)
            if coder.W_skip is not None:
                y = y + x @ coder.W_skip.mT
        return {"x": x, "feature_acts": acts, "sae_out": y, "l0": (acts != 0).sum(-1)}

    cases: list[tuple[str, str, str, Any, Mutation]] = [
        ("normalize_decoder_false", "sae", "normalize_decoder", False, _set("normalize_decoder", False)),
        ("expansion_factor_only", "sae", "num_latents", 0,
         _both(_set("num_latents", 0), _set("expansion_factor", D_SAE // D_IN))),
        ("expansion_factor_mismatch", "sae", "expansion_factor", 3,
         _both(_set("num_latents", 0), _set("expansion_factor", 3))),
        ("num_latents_mismatch", "sae", "num_latents", D_SAE * 2, _set("num_latents", D_SAE * 2)),
        ("d_in_mismatch", "sae", "d_in", D_IN + 1, _set("d_in", D_IN + 1)),
        ("d_in_absent", "sae", "d_in", None, _drop("d_in")),
        ("k_1", "sae", "k", 1, _set("k", 1)),
        ("k_all", "sae", "k", D_SAE, _set("k", D_SAE)),
        ("k_too_big", "sae", "k", D_SAE + 1, _set("k", D_SAE + 1)),
        ("k_zero", "sae", "k", 0, _set("k", 0)),
        ("activation_groupmax", "sae", "activation", "groupmax", _both(_set("activation", "groupmax"),
                                                                      _set("k", 4))),
        ("activation_bogus", "sae", "activation", "jumprelu", _set("activation", "jumprelu")),
        ("multi_topk", "sae", "multi_topk", True, _set("multi_topk", True)),
        ("transcode_on_sae_file", "sae", "transcode", True, _set("transcode", True)),
        ("transcode_false_on_transcoder", "transcoder", "transcode", False, _set("transcode", False)),
        ("skip_without_W_skip", "sae", "skip_connection", True, _set("skip_connection", True)),
        ("W_skip_without_skip", "skip", "skip_connection", False, _set("skip_connection", False)),
        ("skip_sae", "skip", "skip_connection", True, _set("skip_connection", True)),
        ("signed_true", "sae", "signed", True, _set("signed", True)),
        ("signed_false", "sae", "signed", False, _set("signed", False)),
        ("unknown_key", "sae", "some_future_key", 1, _set("some_future_key", 1)),
        ("missing_b_dec", "sae", "tensor b_dec", None, _tensor("b_dec", lambda s: None)),
        ("weights_float64", "sae", "tensor dtype", "float64",
         _tensor("W_dec", lambda s: s["W_dec"].double())),
    ]
    for name, base, field, value, mutate in cases:
        # one hookpoint folder per case: OUT/<case>/ holds cfg.json + sae.safetensors
        _write_case(out, name, bases / base / "layers.1", "cfg.json", "sae.safetensors", field, value, mutate, run)
    shutil.rmtree(bases)

    rng = random.Random(2)
    for i in range(N_COMBOS):
        activation = rng.choice(["topk", "groupmax"])
        kw: dict[str, Any] = {"activation": activation, "transcode": rng.random() < 0.5,
                              "skip_connection": rng.random() < 0.5, "multi_topk": rng.random() < 0.3,
                              "normalize_decoder": rng.random() < 0.5}
        if rng.random() < 0.3:
            kw.update(num_latents=0, expansion_factor=2)
        else:
            kw["num_latents"] = D_SAE
        n = kw["num_latents"] or 2 * D_IN
        ks = [d for d in range(1, n + 1) if activation == "topk" or n % d == 0]
        kw["k"] = rng.choice(ks)

        def save(case: Path, kw: dict[str, Any] = kw) -> None:
            coder = SparseCoder(D_IN, SparseCoderConfig(**kw))
            randomize_(coder, seed=200 + int(case.name[-2:]))
            coder.save_to_disk(case)

        _combo_case(out, f"combo_{i:02d}", kw, save, run)


if __name__ == "__main__":
    peer, target = sys.argv[1], Path(sys.argv[2])
    fresh_output_dir(target)
    out = target
    {"saelens": saelens, "sparsify": sparsify}[peer](out)
    from importlib.metadata import version
    dist = {"saelens": "sae-lens", "sparsify": "eai-sparsify"}[peer]
    (out / "peer.json").write_text(json.dumps({"peer": dist, "version": version(dist),
                                               "torch": torch.__version__}, indent=1))
