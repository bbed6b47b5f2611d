"""The hostile-input table (issue 13): bad files, bad configs, bad tensors and API misuse, each run
and classified by what a user would see.

Support module of ``tests/test_hostile.py`` (which runs this table once, in a fresh interpreter
without the test-time type-checking hook, so that every case sees the package as a user does), and
a script that prints the counts per outcome class::

    PYTHONPATH=. python tests/hostile_cases.py            # table of counts + every non-passing case
    PYTHONPATH=. python tests/hostile_cases.py --json F   # all records as JSON

Each case runs a callable on fresh copies of tiny checkpoint files (written here by our own writers,
or in the peers' layouts as ``tests/formats`` does) or against the tiny model of ``tests/helpers.py``,
and gets one outcome:

``named_error``
    a :class:`~nnsight_lorsa.errors.LorsaError` whose message names what it must (the file, the key,
    the argument);
``correct``
    no error, and the result is the right one (a loaded module whose state and outputs equal the
    unmutated checkpoint's; a trace whose logits equal the reference);
``silent_wrong``
    no error, but bad input accepted or a result that differs from the reference;
``unclear_error``
    one of ours whose message does not name what it must;
``raw_exception``
    a third-party or built-in exception (``TypeError``, ``SafetensorError``, ``JSONDecodeError`` …);
``state_left``
    the model's modules or forward hooks differ after the case (a failing trace must undo itself);
``data_lost``
    a failed save destroyed the files that were there before.

Only the first two pass.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nnsight_lorsa._atomic import MANIFEST

sys.path.insert(0, str(Path(__file__).resolve().parent))

PASS = ("named_error", "correct")
OUTCOMES = ("named_error", "correct", "silent_wrong", "unclear_error", "raw_exception", "state_left", "data_lost")


@dataclass
class Case:
    """One hostile input: ``run(tmp)`` raises or returns; ``check(result)`` says whether a returned
    result is right (None: any return is a silent wrong result); ``needles`` must appear in a named
    error's message; ``model`` is the HF model whose modules and hooks must be unchanged afterwards;
    ``keep`` are files that must still exist, byte-equal, after the case (data loss)."""

    id: str
    group: str
    run: Callable[[Path], Any]
    check: Callable[[Any], bool] | None = None
    needles: tuple[str | tuple[str, ...], ...] = ()
    expect_raise: type | None = None
    model: Any = None
    keep: Callable[[Path], dict[Path, bytes]] | None = None


@dataclass
class Record:
    id: str
    group: str
    outcome: str
    detail: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


# ============================================================================ fixtures
D, F, NQK, DQK, NOV = 16, 32, 2, 8, 16
DELETE = object()


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _r(*shape: int, seed: int = 0, scale: float = 0.3) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=_g(seed + sum(shape)))


def _lorsa():
    from nnsight_lorsa import Lorsa, LorsaConfig
    from nnsight_lorsa.modules.rotary import RotaryConfig

    cfg = LorsaConfig(d_model=D, n_qk_heads=NQK, d_qk_head=DQK, n_ov_heads=NOV, top_k=4,
                      rotary=RotaryConfig(DQK, DQK, 10000.0, False), qk_norm=True, layer=1)
    m = Lorsa(cfg)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(_r(*p.shape, seed=i) + (1.0 if p.dim() == 2 and p.shape == (NQK, DQK) else 0.0))
    return m.eval()


def _coder(kind: str, activation: str = "topk"):
    from nnsight_lorsa.modules import (
        CLTConfig,
        CrossLayerTranscoder,
        SAEConfig,
        SkipTranscoder,
        SparseAutoencoder,
        Transcoder,
        TranscoderConfig,
    )

    params = {"k": 4} if activation == "topk" else {}
    if kind == "sae":
        m: Any = SparseAutoencoder(SAEConfig(d_in=D, d_sae=F, activation=activation, activation_params=params))
    elif kind == "clt":
        m = CrossLayerTranscoder(CLTConfig(d_in=D, d_sae=F, n_layers=2, activation=activation,
                                           activation_params=params))
    else:
        cls = SkipTranscoder if kind == "skip_transcoder" else Transcoder
        m = cls(TranscoderConfig(d_in=D, d_sae=F, activation=activation, activation_params=params, layer=1))
    with torch.no_grad():
        for i, (name, p) in enumerate(m.named_parameters()):
            p.copy_(0.2 * torch.rand(p.shape, generator=_g(i)) if name.endswith("threshold")
                    else _r(*p.shape, seed=i))
    return m.eval()


def _their_lorsa_files(d: Path) -> None:
    """A Llamascopium Lorsa checkpoint (their ``save_pretrained`` layout; see tests/formats)."""
    from safetensors.torch import save_file

    n_ctx = 16
    cfg = {"sae_type": "lorsa", "d_model": D, "expansion_factor": NOV / D, "use_decoder_bias": True,
           "act_fn": "topk", "norm_activation": "inference", "sparsity_include_decoder_norm": True, "top_k": 4,
           "hook_point_in": "blocks.1.ln1.hook_normalized", "hook_point_out": "blocks.1.hook_attn_out",
           "n_qk_heads": NQK, "d_qk_head": DQK, "positional_embedding_type": "rotary", "rotary_dim": DQK,
           "rotary_base": 10000, "rotary_adjacent_pairs": True, "rotary_scale": 1, "use_NTK_by_parts_rope": False,
           "NTK_by_parts_factor": 1.0, "NTK_by_parts_low_freq_factor": 1.0, "NTK_by_parts_high_freq_factor": 1.0,
           "old_context_len": 2048, "n_ctx": n_ctx, "attn_type": "global", "window_size": None,
           "attn_scale": math.sqrt(DQK), "use_post_qk_ln": False, "normalization_type": None, "eps": 1e-6}
    st = {"W_Q": _r(NQK, D, DQK, seed=1), "W_K": _r(NQK, D, DQK, seed=2), "b_Q": _r(NQK, DQK, seed=3),
          "b_K": _r(NQK, DQK, seed=4), "W_V": _r(NOV, D, seed=5), "b_V": _r(NOV, seed=6), "W_O": _r(NOV, D, seed=7),
          "b_D": _r(D, seed=8), "mask": torch.ones(n_ctx, n_ctx).tril().bool(), "IGNORE": torch.tensor(-torch.inf)}
    pos = torch.arange(n_ctx, dtype=torch.float32)
    freq = (10000 ** (torch.arange(DQK // 2, dtype=torch.float32) / (DQK / 2))).repeat_interleave(2)
    ang = pos[:, None] / freq[None, :]
    st["rotary_sin"], st["rotary_cos"] = torch.sin(ang), torch.cos(ang)
    for hook in (cfg["hook_point_in"], cfg["hook_point_out"]):
        st[f"dataset_average_activation_norm.{hook}"] = torch.tensor(2.0)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(st, str(d / "sae_weights.safetensors"), {"version": "2.0.0b34"})


def _their_sae_files(d: Path) -> None:
    from safetensors.torch import save_file

    hook = "blocks.1.hook_resid_post"
    cfg = {"sae_type": "sae", "d_model": D, "expansion_factor": F / D, "act_fn": "topk", "top_k": 4,
           "use_decoder_bias": True, "use_glu_encoder": False, "sparsity_include_decoder_norm": True,
           "norm_activation": "dataset-wise", "hook_point_in": hook, "hook_point_out": hook}
    st = {"W_E": _r(D, F, seed=1), "b_E": _r(F, seed=2), "W_D": _r(F, D, seed=3), "b_D": _r(D, seed=4),
          f"dataset_average_activation_norm.{hook}": torch.tensor(3.0)}
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(st, str(d / "sae_weights.safetensors"))
    # their Trainer.save_checkpoint's marker: a "dataset-wise" folder there holds unfolded weights (only its
    # presence is read; elsewhere the files cannot say whether the weights are folded and the load is refused)
    (d / "trainer.pt").touch()


def build_fixtures(root: Path) -> dict[str, Path]:
    """One clean checkpoint directory per format (and kind), under ``root``."""
    from nnsight_lorsa.formats import save
    from nnsight_lorsa.formats.saelens import save_saelens

    dirs = {}

    def at(name: str) -> Path:
        dirs[name] = root / name
        return dirs[name]

    save(_lorsa(), at("ours_lorsa"))
    save(_coder("sae"), at("ours_sae"))
    save(_coder("skip_transcoder", "jumprelu"), at("ours_transcoder"))
    save(_coder("clt", "jumprelu"), at("ours_clt"))
    save_saelens(_coder("sae"), at("saelens_topk"), hook_name="blocks.1.hook_resid_post")
    save_saelens(_coder("transcoder", "jumprelu"), at("saelens_jumprelu_transcoder"),
                 hook_name="blocks.1.ln2.hook_normalized")
    save(_coder("sae"), at("sparsify_sae") / "layers.1", format="sparsify")
    dirs["sparsify_sae"] = dirs["sparsify_sae"] / "layers.1"
    save(_coder("skip_transcoder"), at("sparsify_skip") / "layers.1.mlp", format="sparsify")
    dirs["sparsify_skip"] = dirs["sparsify_skip"] / "layers.1.mlp"
    _their_lorsa_files(at("llamascopium_lorsa"))
    _their_sae_files(at("llamascopium_sae"))
    # one skip flag for the set (circuit-tracer takes layer 0's for every layer: a mixed set is refused on save)
    save({0: _coder("skip_transcoder", "jumprelu"), 1: _coder("skip_transcoder", "relu")}, at("ct_transcoders"),
         format="circuit_tracer")
    save(_coder("clt", "jumprelu"), at("ct_clt"), format="circuit_tracer")
    return dirs


# ============================================================================ mutations
def _set_path(doc: Any, keys: tuple[str, ...], value: Any) -> None:
    for k in keys[:-1]:
        doc = doc[k]
    if value is DELETE:
        doc.pop(keys[-1], None)
    else:
        doc[keys[-1]] = value


def edit_json(file: Path, keys: tuple[str, ...], value: Any) -> None:
    doc = json.loads(file.read_text())
    _set_path(doc, keys, value)
    file.write_text(json.dumps(doc))  # NaN / Infinity written as JSON's non-standard tokens, as Python reads them


def edit_yaml(file: Path, keys: tuple[str, ...], value: Any) -> None:
    import yaml

    doc = yaml.safe_load(file.read_text()) or {}
    _set_path(doc, keys, value)
    file.write_text(yaml.safe_dump(doc))


def edit_tensor(file: Path, key: str, how: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    st = load_file(str(file))
    t = st[key]
    if how in ("nan", "inf") and not t.is_floating_point():
        t = t.float()  # integer / bool tensors: the bad value comes with a float dtype
    if how == "nan":
        t = t.clone().reshape(-1)
        t[0] = float("nan")
        st[key] = t.reshape(st[key].shape)
    elif how == "inf":
        t = t.clone().reshape(-1)
        t[-1] = float("inf")
        st[key] = t.reshape(st[key].shape)
    elif how == "int":
        st[key] = (t.round() if t.is_floating_point() else t).to(torch.int32)
    elif how == "shrink":
        st[key] = t[..., :-1].contiguous() if t.dim() else t.reshape(1)
    elif how == "extra_dim":
        st[key] = t.unsqueeze(0).contiguous()
    elif how == "missing":
        del st[key]
    elif how == "renamed":
        st[key + "_renamed"] = st.pop(key)
    save_file(st, str(file), meta)


def corrupt_file(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif how == "truncated_header":
        file.write_bytes(data[:12])
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "garbage":
        file.write_bytes(bytes(range(256)) * 4)
    elif how == "huge_header_len":  # a safetensors header length pointing past the file
        file.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    elif how == "deep_json":
        file.write_text("[" * 100_000 + "]" * 100_000)
    elif how == "json_array":
        file.write_text("[1, 2, 3]")
    elif how == "json_string":
        file.write_text('"config"')
    elif how == "not_utf8":
        file.write_bytes(b"\xff\xfe{\x00")
    elif how == "deleted":
        file.unlink()
    elif how == "directory":
        file.unlink()
        file.mkdir()


# ============================================================================ checks
def _probe(m: Any) -> torch.Tensor | list:
    from nnsight_lorsa import Lorsa
    from nnsight_lorsa.formats.circuit_tracer import CircuitTracerTranscoders
    from nnsight_lorsa.modules import CrossLayerTranscoder

    x = torch.randn(2, 5, D, generator=_g(123))
    with torch.no_grad():
        if isinstance(m, CircuitTracerTranscoders):
            return [_probe(m[i]) for i in range(len(m))]
        if isinstance(m, Lorsa):
            return m(x)
        if isinstance(m, CrossLayerTranscoder):
            return m(torch.stack([x] * m.n_layers))
        return m(x)


def same_module(a: Any, b: Any) -> bool:
    """Same type, same state (bit-equal) and same outputs on a fixed input."""
    from nnsight_lorsa.formats.circuit_tracer import CircuitTracerTranscoders

    if type(a) is not type(b):
        return False
    if isinstance(a, CircuitTracerTranscoders):
        return sorted(a.transcoders) == sorted(b.transcoders) and all(
            same_module(a[i], b[i]) for i in a.transcoders)
    sa, sb = a.state_dict(), b.state_dict()
    if sorted(sa) != sorted(sb) or any(sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k]) for k in sa):
        return False
    pa, pb = _probe(a), _probe(b)
    return bool(torch.equal(pa, pb)) if isinstance(pa, torch.Tensor) else pa == pb or all(
        torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


# ============================================================================ loader cases
SIZE_VALUES: dict[str, Any] = {
    "bool": True, "float_integral": 8.0, "float": 2.5, "zero": 0, "negative": -3, "huge": 10**12,
    "absurd": 10**40, "nan": float("nan"), "inf": float("inf"), "string": "8", "list": [8], "dict": {"v": 8},
    "null": None, "missing": DELETE,
}
FLOAT_VALUES: dict[str, Any] = {
    "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "string": "1.0", "bool": True, "list": [1.0],
    "zero": 0, "negative": -1.0, "null": None, "missing": DELETE,
}
ENUM_VALUES: dict[str, Any] = {"unknown": "no-such-thing", "int": 3, "bool": False, "null": None, "list": ["topk"],
                               "missing": DELETE}
BOOL_VALUES: dict[str, Any] = {"int": 1, "string": "true", "null": None, "missing": DELETE, "list": [True]}

#: per format: (fixture, config file, {json key path: value table}), tensors file, tensors to mutate
LOADERS: dict[str, dict[str, Any]] = {
    "ours_lorsa": {
        "config": "config.json", "weights": "model.safetensors",
        "keys": {("config", "d_model"): SIZE_VALUES, ("config", "n_qk_heads"): SIZE_VALUES,
                 ("config", "d_qk_head"): SIZE_VALUES, ("config", "n_ov_heads"): SIZE_VALUES,
                 ("config", "top_k"): SIZE_VALUES, ("config", "attn_scale"): FLOAT_VALUES,
                 ("config", "qk_norm_eps"): FLOAT_VALUES, ("config", "rotary", "base"): FLOAT_VALUES,
                 ("config", "rotary", "rotary_dim"): SIZE_VALUES, ("config", "qk_norm"): BOOL_VALUES,
                 ("config", "rotary", "rope_type"): ENUM_VALUES, ("config", "layer"): {"float": 1.5, "bool": True,
                                                                                     "negative": -1, "string": "1"},
                 ("version",): {"two": 2, "string": "1", "missing": DELETE},
                 ("format",): {"other": "nnsight-lorsa-sparse-coder", "missing": DELETE},
                 ("config",): {"list": [], "nested": {"config": {"d_model": D}}, "string": "x"}},
        "tensors": ("W_Q", "W_K", "b_Q", "b_K", "W_V", "b_V", "W_O", "b_D", "ln_q.w"),
    },
    "ours_sae": {
        "config": "config.json", "weights": "model.safetensors",
        "keys": {("config", "d_in"): SIZE_VALUES, ("config", "d_sae"): SIZE_VALUES,
                 ("config", "activation"): ENUM_VALUES, ("config", "activation_params", "k"): SIZE_VALUES,
                 ("config", "apply_b_dec_to_input"): BOOL_VALUES, ("kind",): ENUM_VALUES,
                 ("config", "activation_params"): {"list": [4], "extra": {"k": 4, "bogus": 1}}},
        "tensors": ("W_enc", "b_enc", "W_dec", "b_dec"),
    },
    "ours_transcoder": {
        "config": "config.json", "weights": "model.safetensors",
        "keys": {("config", "d_out"): SIZE_VALUES, ("config", "activation_params", "bandwidth"): FLOAT_VALUES},
        "tensors": ("W_enc", "W_skip", "activation.threshold"),
    },
    "ours_clt": {
        "config": "config.json", "weights": "model.safetensors",
        "keys": {("config", "n_layers"): SIZE_VALUES, ("config", "skip"): BOOL_VALUES},
        "tensors": ("W_enc", "b_enc"),
    },
    "saelens_topk": {
        "config": "cfg.json", "weights": "sae_weights.safetensors",
        "keys": {("d_in",): SIZE_VALUES, ("d_sae",): SIZE_VALUES, ("k",): SIZE_VALUES,
                 ("architecture",): ENUM_VALUES, ("apply_b_dec_to_input",): BOOL_VALUES,
                 ("normalize_activations",): ENUM_VALUES, ("rescale_acts_by_decoder_norm",): BOOL_VALUES,
                 ("metadata",): {"list": [], "string": "x"}, ("metadata", "hook_name"): {"int": 3, "list": ["a"]}},
        "tensors": ("W_enc", "b_enc", "W_dec", "b_dec"),
        "defaults": {("apply_b_dec_to_input",), ("normalize_activations",), ("rescale_acts_by_decoder_norm",)},
    },
    "saelens_jumprelu_transcoder": {
        "config": "cfg.json", "weights": "sae_weights.safetensors",
        "keys": {("d_out",): SIZE_VALUES, ("architecture",): {"topk": "topk", "standard": "standard",
                                                               "missing": DELETE}},
        "tensors": ("threshold", "W_dec"),
    },
    "sparsify_sae": {
        "config": "cfg.json", "weights": "sae.safetensors",
        "keys": {("d_in",): SIZE_VALUES, ("k",): SIZE_VALUES, ("num_latents",): SIZE_VALUES,
                 ("expansion_factor",): FLOAT_VALUES, ("activation",): ENUM_VALUES, ("transcode",): BOOL_VALUES,
                 ("skip_connection",): BOOL_VALUES},
        "tensors": ("encoder.weight", "encoder.bias", "W_dec", "b_dec"),
        "defaults": {("activation",), ("transcode",), ("skip_connection",), ("num_latents",)},
    },
    "sparsify_skip": {
        "config": "cfg.json", "weights": "sae.safetensors",
        "keys": {("skip_connection",): {"false": False, "missing": DELETE}},
        "tensors": ("W_skip",),
    },
    "llamascopium_lorsa": {
        "config": "config.json", "weights": "sae_weights.safetensors",
        "keys": {("d_model",): SIZE_VALUES, ("n_qk_heads",): SIZE_VALUES, ("d_qk_head",): SIZE_VALUES,
                 ("top_k",): SIZE_VALUES, ("expansion_factor",): FLOAT_VALUES, ("attn_scale",): FLOAT_VALUES,
                 ("rotary_base",): FLOAT_VALUES, ("rotary_dim",): SIZE_VALUES, ("n_ctx",): SIZE_VALUES,
                 ("act_fn",): ENUM_VALUES, ("norm_activation",): ENUM_VALUES, ("sae_type",): ENUM_VALUES,
                 ("hook_point_in",): {"int": 3, "list": ["a"], "missing": DELETE},
                 ("rotary_adjacent_pairs",): BOOL_VALUES, ("use_NTK_by_parts_rope",): BOOL_VALUES,
                 ("positional_embedding_type",): ENUM_VALUES, ("eps",): FLOAT_VALUES,
                 ("use_decoder_bias",): BOOL_VALUES},
        "tensors": ("W_Q", "W_K", "b_Q", "b_K", "W_V", "b_V", "W_O", "b_D", "rotary_sin", "mask"),
        # their pydantic defaults (LorsaConfig / BaseSAEConfig): a file without the key means them
        "defaults": {("act_fn",), ("norm_activation",), ("eps",), ("use_decoder_bias",), ("rotary_adjacent_pairs",),
                     ("use_NTK_by_parts_rope",), ("positional_embedding_type",), ("attn_scale",),
                     ("rotary_base",), ("top_k",)},
    },
    "llamascopium_sae": {
        "config": "config.json", "weights": "sae_weights.safetensors",
        "keys": {("d_model",): SIZE_VALUES, ("expansion_factor",): FLOAT_VALUES, ("top_k",): SIZE_VALUES,
                 ("act_fn",): ENUM_VALUES, ("norm_activation",): ENUM_VALUES,
                 ("sparsity_include_decoder_norm",): BOOL_VALUES, ("use_decoder_bias",): BOOL_VALUES},
        "tensors": ("W_E", "b_E", "W_D", "b_D", "dataset_average_activation_norm.blocks.1.hook_resid_post"),
        "defaults": {("act_fn",), ("norm_activation",), ("sparsity_include_decoder_norm",), ("use_decoder_bias",)},
    },
    "ct_transcoders": {
        "config": "config.yaml", "weights": "layer_0.safetensors", "yaml": True,
        "keys": {("model_kind",): ENUM_VALUES, ("activation",): ENUM_VALUES,
                 ("transcoders",): {"string": "layer_0.safetensors", "int": 3, "pickle": ["layer_0.pt", "layer_1.pt"],
                                    "one_missing": ["layer_0.safetensors"], "dict": {"a": 1},
                                    "bad_entry": [{"layer": "x", "filepath": "layer_0.safetensors"},
                                                  {"layer": 1, "filepath": "layer_1.safetensors"}]},
                 ("k",): {"float": 2.5}},
        # circuit-tracer's own key for the JumpReLU threshold (what our save writes, as it does)
        "tensors": ("W_enc", "b_enc", "W_dec", "b_dec", "activation_function.threshold"),
        "optional": ("activation_function.threshold",),  # without one: a ReLU transcoder (circuit-tracer's rule)
        "defaults": {("model_kind",), ("activation",)},
    },
    "ct_clt": {
        "config": "config.yaml", "weights": "W_enc_0.safetensors", "yaml": True,
        "keys": {("model_kind",): ENUM_VALUES},
        "tensors": ("W_enc_0", "b_enc_0", "b_dec_0", "threshold_0"),
        "defaults": {("model_kind",)},
    },
}

CONFIG_CORRUPTIONS = ("truncated", "empty", "garbage", "deep_json", "json_array", "json_string", "not_utf8",
                      "deleted", "directory")
WEIGHT_CORRUPTIONS = ("truncated", "truncated_header", "empty", "garbage", "huge_header_len", "deleted", "directory")
TENSOR_EDITS = ("nan", "inf", "int", "shrink", "extra_dim", "missing", "renamed")


def _key_needle(keys: tuple[str, ...]) -> str:
    return keys[-1]


def _equal_to(ref: Any) -> Callable[[Any], bool]:
    return lambda m: same_module(m, ref)


def _same_type(ref: Any) -> Callable[[Any], bool]:
    return lambda m: type(m) is type(ref)


def loader_cases(fixtures: dict[str, Path], refs: dict[str, Any]) -> list[Case]:
    from nnsight_lorsa.formats import load

    cases = []
    for name, spec in LOADERS.items():
        base = fixtures[name]

        def make(mutate: Callable[[Path], None], base: Path = base) -> Callable[[Path], Any]:
            def run(tmp: Path) -> Any:
                d = tmp / base.name
                shutil.copytree(base, d)
                (d / MANIFEST).unlink(missing_ok=True)  # the readers on hand-edited files (no checksums.json)
                mutate(d)
                return load(d)
            return run

        ref = refs[name]
        ok = _equal_to(ref)
        edit = edit_yaml if spec.get("yaml") else edit_json
        loads = _same_type(ref)
        for keys, values in spec["keys"].items():
            for label, value in values.items():
                defaulted = label in ("missing", "null") and keys in spec.get("defaults", ())
                cases.append(Case(
                    f"{name}/config/{'.'.join(keys)}={label}", f"config:{name}",
                    make(lambda d, keys=keys, value=value, edit=edit, f=spec["config"]: edit(d / f, keys, value)),
                    check=loads if defaulted else ok,
                    needles=((spec["config"], spec["weights"]), (_key_needle(keys), "tensor", "key '"))))
        configs = ("truncated", "empty", "garbage", "deleted") if spec.get("yaml") else CONFIG_CORRUPTIONS
        for how in configs:
            cases.append(Case(f"{name}/file/{spec['config']}:{how}", "file",
                              make(lambda d, how=how, f=spec["config"]: corrupt_file(d / f, how)),
                              check=ok if (spec.get("yaml") and how in ("empty", "deleted")) else None,
                              needles=() if spec.get("yaml") else (spec["config"],)))
        for how in WEIGHT_CORRUPTIONS:
            cases.append(Case(f"{name}/file/{spec['weights']}:{how}", "file",
                              make(lambda d, how=how, f=spec["weights"]: corrupt_file(d / f, how)),
                              needles=(spec["weights"],) if how not in ("deleted",) or not spec.get("yaml") else ()))
        for key in spec["tensors"]:
            for how in TENSOR_EDITS:
                optional = how == "missing" and key in spec.get("optional", ())
                cases.append(Case(f"{name}/tensor/{key}:{how}", f"tensor:{name}",
                                  make(lambda d, key=key, how=how, f=spec["weights"]: edit_tensor(d / f, key, how)),
                                  check=loads if optional else ok, needles=(".safetensors", (key, "tensor"))))
    by_id = {c.id: c for c in cases}
    # config.yaml listing only layer 0: the set is what the file lists (circuit-tracer loads the listed files)
    by_id["ct_transcoders/config/transcoders=one_missing"].check = (
        lambda m, ref=refs["ct_transcoders"]: sorted(m.transcoders) == [0] and same_module(m[0], ref[0]))
    return cases


# ============================================================================ other files
def _graph_fixture(root: Path) -> Path:
    from helpers import attribution_setup, random_ids, rm

    from nnsight_lorsa.attribution import attribute

    model, hf, lorsas, tcs = attribution_setup("llama")
    graph = attribute(rm(model, lorsas, tcs), random_ids(1, 4, seed=5)[0], batch_size=16)
    blocks = graph.save(root / "graph")  # the full graph keeps its causal blocks: saved as blocks
    graph.densify()
    graph.save(root / "graph_dense")  # the same graph holding its dense matrix: saved as the (n, n) tensor
    return blocks


def _same_graph(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.densify(), b.densify()) and torch.equal(a.tokens, b.tokens)
                and torch.equal(a.nodes.pos, b.nodes.pos) and a.meta == b.meta)


def graph_cases(root: Path) -> list[Case]:
    from nnsight_lorsa.attribution import Graph

    base = _graph_fixture(root)
    ref = Graph.load(base)

    def make(mutate: Callable[[Path], None], source: Path = base) -> Callable[[Path], Any]:
        def run(tmp: Path) -> Any:
            d = tmp / "graph"
            shutil.copytree(source, d)
            (d / MANIFEST).unlink(missing_ok=True)  # the readers on hand-edited files (no checksums.json)
            mutate(d)
            return Graph.load(d)
        return run

    ok = lambda g: _same_graph(g, ref)  # noqa: E731
    cases = []
    for how in CONFIG_CORRUPTIONS:
        cases.append(Case(f"graph/graph.json:{how}", "graph",
                          make(lambda d, how=how: corrupt_file(d / "graph.json", how)),
                          needles=("graph.json",)))
    for how in WEIGHT_CORRUPTIONS:
        cases.append(Case(f"graph/graph.safetensors:{how}", "graph",
                          make(lambda d, how=how: corrupt_file(d / "graph.safetensors", how)),
                          needles=("graph.safetensors",)))
    dense = base.parent / "graph_dense"  # the dense adjacency's file: its "adjacency" tensor
    for key in ("tokens", "adjacency", "values", "logit_probs", "feature_rows", "layout_ids", "residual", "node_kind",
                "node_layer", "node_pos", "node_index", "node_activation", "adjacency_rows", "adjacency_blocks",
                "adjacency_sources"):
        for how in ("nan", "inf", "int", "shrink", "extra_dim", "missing"):
            cases.append(Case(f"graph/tensor/{key}:{how}", "graph",
                              make(lambda d, key=key, how=how: edit_tensor(d / "graph.safetensors", key, how),
                                   dense if key == "adjacency" else base),
                              check=ok, needles=("graph.safetensors", (key, "tensor"))))

    def tamper(key: str, value: Any) -> Callable[[Path], None]:
        def mutate(d: Path) -> None:
            from safetensors.torch import load_file, save_file

            st = load_file(str(d / "graph.safetensors"))
            t = st[key].clone()
            t.view(-1)[0] = value
            st[key] = t
            save_file(st, str(d / "graph.safetensors"))
        return mutate

    for key, value in (("node_layer", 99), ("node_layer", -7), ("node_pos", 50), ("node_pos", -5), ("node_kind", 42),
                       ("node_kind", -1), ("tokens", -3), ("logit_probs", 2.0), ("logit_probs", -0.5),
                       ("node_index", -9), ("layout_ids", -1)):
        cases.append(Case(f"graph/tamper/{key}={value}", "graph", make(tamper(key, value)),
                          check=ok, needles=("graph.safetensors", key)))
    for keys, value in ((("format",), "other/2"), (("meta",), [1, 2]), (("meta",), "x"), (("prompt",), 3),
                        (("bias_names",), "b"), (("bias_names",), [1, 2]), (("bias_names",), DELETE),
                        (("meta",), DELETE), (("format",), DELETE)):
        cases.append(Case(f"graph/json/{keys[0]}={value if value is not DELETE else 'missing'!r}", "graph",
                          make(lambda d, keys=keys, value=value: edit_json(d / "graph.json", keys, value)),
                          check=ok, needles=("graph.json", keys[0])))
    return cases


def gate_cases(root: Path) -> list[Case]:
    from helpers import tiny_hf_model

    from nnsight_lorsa.sparse_attention import install_gated_attention, load_gates
    from nnsight_lorsa.sparse_attention.io import save_gates

    src = tiny_hf_model("llama")
    install_gated_attention(src)
    base = save_gates(src, root / "gates")

    def make(mutate: Callable[[Path], None]) -> Callable[[Path], Any]:
        def run(tmp: Path) -> Any:
            d = tmp / "gates"
            shutil.copytree(base, d)
            (d / MANIFEST).unlink(missing_ok=True)  # the readers on hand-edited files (no checksums.json)
            mutate(d)
            return load_gates(tiny_hf_model("llama"), d)
        return run

    ok = lambda gates: len(gates) == 3  # noqa: E731 — an unmutated load is the reference (same biases checked below)
    cases = []
    values = {"temperature": FLOAT_VALUES, "n_layers": SIZE_VALUES, "n_heads": SIZE_VALUES,
              "top_k": {"float": 2.5, "bool": True, "zero": 0}, "mode": ENUM_VALUES, "format": {"other": "x"},
              "model_type": {"other": "gpt2", "int": 3}, "bogus": {"extra": 1}}
    for key, table in values.items():
        for label, value in table.items():
            # the saved values are the defaults
            defaulted = key in ("temperature", "mode") and label in ("missing", "null")
            cases.append(Case(f"gates/json/{key}={label}", "gates",
                              make(lambda d, key=key, value=value: edit_json(d / "sparse_attention.json", (key,),
                                                                             value)),
                              check=ok if defaulted else None,
                              needles=("sparse_attention.json",)))
    for how in CONFIG_CORRUPTIONS:
        cases.append(Case(f"gates/file/sparse_attention.json:{how}", "gates",
                          make(lambda d, how=how: corrupt_file(d / "sparse_attention.json", how)),
                          needles=("sparse_attention.json",)))
    for how in WEIGHT_CORRUPTIONS:
        cases.append(Case(f"gates/file/sparse_attention.safetensors:{how}", "gates",
                          make(lambda d, how=how: corrupt_file(d / "sparse_attention.safetensors", how)),
                          needles=("sparse_attention.safetensors",)))
    for how in ("nan", "inf", "int", "shrink", "missing"):
        cases.append(Case(f"gates/tensor/layers.0.bias:{how}", "gates",
                          make(lambda d, how=how: edit_tensor(d / "sparse_attention.safetensors", "layers.0.bias",
                                                              how)),
                          needles=("sparse_attention.safetensors", "layers.0.bias")))
    return cases


# ============================================================================ API / trace misuse
def _state(hf: Any) -> tuple:
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(getattr(m, "_backward_hooks", {}))
                for m in hf.modules())
    return hooks, tuple(n for n, _ in hf.named_modules()), tuple(hf.state_dict())


def api_cases(root: Path) -> list[Case]:
    import nnsight
    from helpers import LAYER, make_lorsa, make_sae, make_transcoder, random_ids, tiny_nnsight

    from nnsight_lorsa import LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
    from nnsight_lorsa.attribution import LogitTargets, attribute
    from nnsight_lorsa.envoy import CLTSet
    from nnsight_lorsa.formats import save

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter)
    lorsas = LorsaSet(model, {LAYER: lorsa})
    tcs = TranscoderSet(model, {0: make_transcoder(), 2: make_transcoder(skip=False)})
    site = adapter.attention_norm_path(LAYER)
    saes = SAESet(model, {site: make_sae()})
    other, other_hf = tiny_nnsight("gpt2")
    ids = random_ids(1, 6)
    with torch.no_grad():
        ref_logits = hf(ids).logits
    cases: list[Case] = []

    def traced(body: Callable[[], Any], kind: str = "trace", **kw: Any) -> Callable[[Path], Any]:
        def run(tmp: Path) -> Any:
            out: list = []
            with getattr(model, kind)(ids, **kw):
                body()
                out.append(nnsight.save(model.lm_head.output))
            return out[0]
        return run

    def unchanged_logits(logits: Any) -> bool:
        return isinstance(logits, torch.Tensor) and torch.allclose(logits, ref_logits, atol=1e-5)

    bad_keys: dict[str, Any] = {"float": 2.0, "string": "1", "bool": True, "empty_list": [], "float_in_list": [1.5],
                                "none_in_list": [None], "dict": {1: 1}, "tensor_float": torch.tensor(1.0),
                                "bytes": b"1", "nested_list": [[1]], "set_empty": set(), "object": object(),
                                "tensor_2d": torch.tensor([[1]]), "generator": (i for i in [1.5])}
    for set_name, s, good in (("LorsaSet", lorsas, LAYER), ("TranscoderSet", tcs, 0)):
        for label, key in bad_keys.items():
            cases.append(Case(f"api/{set_name}.replace(layer={label})", "api",
                              traced(lambda s=s, key=key: s.replace(key)), needles=(("layer", "empty", "mapping"),),
                              model=hf))
        for label, key in {"out_of_range": 7, "negative": -1, "not_in_set": 1 if s is tcs else 0,
                           "huge": 10**12, "numpy_bad": __import__("numpy").int64(9)}.items():
            cases.append(Case(f"api/{set_name}.replace(layer={label})", "api",
                              traced(lambda s=s, key=key: s.replace(key)), needles=("layer",), model=hf))
        cases.append(Case(f"api/{set_name}.replace outside a trace", "api", lambda tmp, s=s, good=good: s.replace(good),
                          needles=("inside a model.trace",), model=hf))
        cases.append(Case(f"api/{set_name}.replace(error='yes')", "api",
                          traced(lambda s=s, good=good: s.replace(good, error="yes")), needles=("error",), model=hf))
        cases.append(Case(f"api/{set_name}.replace(error=True) leaves logits unchanged", "api",
                          traced(lambda s=s, good=good: s.replace(good, error=True)), check=unchanged_logits, model=hf))
    for label, key in {"int": 1, "unknown_path": "model.layers.9.mlp", "empty_list": [], "bytes": b"x"}.items():
        cases.append(Case(f"api/SAESet.replace({label})", "api", traced(lambda key=key: saes.replace(key)),
                          needles=(("site", "path", "empty"),), model=hf))

    def read_after() -> None:  # the Lorsa is requested after its layer already ran
        nnsight.save(model.model.layers[2].output)
        lorsas.replace(LAYER)

    cases.append(Case("api/replace after the layer ran", "api", traced(read_after), needles=("already",), model=hf))

    def internals_out_of_order() -> None:
        s = lorsas.replace(LAYER)
        nnsight.save(s.hook_out.output)
        nnsight.save(s.hook_q.output)  # hook_q runs before hook_out

    # nnsight's own named error for a read after the value went by (docs: OutOfOrderError)
    from nnsight.intervention.interleaver import OutOfOrderError

    cases.append(Case("api/Lorsa internals read out of order", "api", traced(internals_out_of_order),
                      expect_raise=OutOfOrderError, needles=("hook_q",), model=hf))

    def raising_body() -> None:
        lorsas.replace(LAYER)
        tcs.replace(0)
        raise KeyError("user code failed")

    cases.append(Case("api/user error inside a trace with replacements", "api", traced(raising_body),
                      expect_raise=KeyError, model=hf))
    cases.append(Case("api/LorsaSet with a Lorsa of another width", "api",
                      lambda tmp: LorsaSet(model, {LAYER: _lorsa()}), needles=("d_model",), model=hf))
    cases.append(Case("api/ReplacementModel with another model's set", "api",
                      lambda tmp: ReplacementModel(other, lorsas=lorsas), needles=("lorsas",), model=other_hf))
    for label, value in {"list": [lorsa], "module": lorsa, "string": "lorsas", "int": 3}.items():
        cases.append(Case(f"api/ReplacementModel(lorsas={label})", "api",
                          lambda tmp, value=value: ReplacementModel(model, lorsas=value), needles=("lorsas",),
                          model=hf))
    for label, value in {"lorsa": lorsa, "list": [1], "string": "tc"}.items():
        cases.append(Case(f"api/ReplacementModel(transcoders={label})", "api",
                          lambda tmp, value=value: ReplacementModel(model, transcoders=value),
                          needles=("transcoders",), model=hf))
    cases.append(Case("api/TranscoderSet keyed by a float", "api",
                      lambda tmp: TranscoderSet(model, {1.0: make_transcoder()}), needles=("layer",), model=hf))
    cases.append(Case("api/LorsaSet with a transcoder", "api",
                      lambda tmp: LorsaSet(model, {LAYER: make_transcoder()}), needles=("Lorsa",), model=hf))
    cases.append(Case("api/CLTSet with a transcoder", "api", lambda tmp: CLTSet(model, make_transcoder()),
                      needles=("CrossLayerTranscoder",), model=hf))

    rmodel = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
    prompt = random_ids(1, 5, seed=3)[0]
    attribute_bad: dict[str, dict[str, Any]] = {
        "batch_size=0": {"batch_size": 0}, "batch_size=-2": {"batch_size": -2}, "batch_size=2.5": {"batch_size": 2.5},
        "batch_size=True": {"batch_size": True}, "max_feature_nodes=0": {"max_feature_nodes": 0},
        "max_feature_nodes=-1": {"max_feature_nodes": -1}, "max_feature_nodes=1.5": {"max_feature_nodes": 1.5},
        "memory=fastest": {"memory": "fastest"},
        "targets=[999]": {"targets": [999]}, "targets=[-1]": {"targets": [-1]},
        "targets=[]": {"targets": []}, "targets=[1.5]": {"targets": [1.5]}, "targets=[True]": {"targets": [True]},
        "targets=w3": {"targets": "w3"}, "targets=[w3 w4]": {"targets": ["w3 w4"]},
        "targets=[3, w4]": {"targets": [3, "w4"]}, "targets=0.9": {"targets": 0.9},
        "targets=float tensor": {"targets": torch.tensor([3.0])},
        "logit_tokens=[3]": {"logit_tokens": [3]}, "desired_logit_prob=0.9": {"desired_logit_prob": 0.9},
        "max_n_logits=3": {"max_n_logits": 3},
        "prune=(2,0.9)": {"prune": (2.0, 0.9)}, "prune=(0.8,)": {"prune": (0.8,)}, "prune=str": {"prune": "yes"},
        "dtype=int64": {"dtype": torch.int64}, "remote=maybe": {"remote": "maybe"},
    }
    for label, kw in attribute_bad.items():
        cases.append(Case(f"api/attribute({label})", "api", lambda tmp, kw=kw: attribute(rmodel, prompt, **kw),
                          needles=(label.split("=")[0],), model=hf))
    policy_bad: dict[str, dict[str, Any]] = {
        "cumulative_prob=1.5": {"cumulative_prob": 1.5}, "cumulative_prob=nan": {"cumulative_prob": math.nan},
        "cumulative_prob=0": {"cumulative_prob": 0.0}, "cumulative_prob=str": {"cumulative_prob": "0.9"},
        "max_n=0": {"max_n": 0}, "max_n=2.5": {"max_n": 2.5},
    }
    for label, kw in policy_bad.items():
        cases.append(Case(f"api/attribute(targets=LogitTargets({label}))", "api",
                          lambda tmp, kw=kw: attribute(rmodel, prompt, targets=LogitTargets(**kw)),
                          needles=(label.split("=")[0],), model=hf))
    for label, p in {"empty": torch.zeros(0, dtype=torch.long), "2d_batch2": random_ids(2, 5),
                     "float_ids": prompt.float(), "out_of_vocab": torch.tensor([0, 5, 500]),
                     "negative_id": torch.tensor([0, -4, 3]),
                     "list_of_str": ["a", "b"], "none": None}.items():
        cases.append(Case(f"api/attribute(prompt={label})", "api", lambda tmp, p=p: attribute(rmodel, p),
                          needles=("prompt",), model=hf))
    cases.append(Case("api/attribute(plain model)", "api", lambda tmp: attribute(model, prompt),
                      needles=("ReplacementModel",), model=hf))

    def dup_layer_folders(tmp: Path) -> Any:
        d = tmp / "set"
        save(make_transcoder(), d / "layer_2", format="nnsight_lorsa")
        save(make_transcoder(seed=1), d / "layer_02", format="nnsight_lorsa")
        return TranscoderSet.from_pretrained(model, d)

    cases.append(Case("api/layer_2 and layer_02 side by side", "api", dup_layer_folders, needles=("layer_02",),
                      model=hf))

    def dup_lorsa_folders(tmp: Path) -> Any:
        d = tmp / "set"
        save(lorsa, d / "layer_1")
        save(lorsa, d / "layer_01")
        return LorsaSet.from_pretrained(model, d)

    cases.append(Case("api/Lorsa layer_1 and layer_01 side by side", "api", dup_lorsa_folders,
                      needles=("layer_01", "layer_1"), model=hf))

    for label, kw in {"num_beams=2": {"num_beams": 2}, "penalty_alpha": {"penalty_alpha": 0.6, "top_k": 4},
                      "num_beam_groups": {"num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 1.0}}.items():
        cases.append(Case(f"api/generate({label}) with a Lorsa", "api",
                          traced(lambda: lorsas.replace(LAYER), kind="generate", max_new_tokens=2, pad_token_id=1,
                                 **kw),
                          needles=("num_beams=1",), model=hf))

    def beams_in_config(tmp: Path) -> Any:
        hf.generation_config.num_beams = 2
        try:
            return traced(lambda: lorsas.replace(LAYER), kind="generate", max_new_tokens=2, pad_token_id=1)(tmp)
        finally:
            hf.generation_config.num_beams = 1

    cases.append(Case("api/generation_config.num_beams=2 with a Lorsa", "api", beams_in_config,
                      needles=("beam search",), model=hf))

    # data loss: a failing save keeps what was there
    def save_over(obj: Any, **kw: Any) -> Callable[[Path], Any]:
        def run(tmp: Path) -> Any:
            return save(obj, tmp / "ckpt", **kw)
        return run

    def keep_ckpt(tmp: Path) -> dict[Path, bytes]:
        d = tmp / "ckpt"
        save(lorsa, d)
        return {p: p.read_bytes() for p in d.iterdir()}

    for label, (obj, kw, needle) in {
        "format=unknown": (lorsa, {"format": "npz"}, "npz"),
        "object=str": ("lorsa", {}, "str"),
        "sparsify of a Lorsa": (lorsa, {"format": "sparsify"}, "Lorsa"),
        "saelens hook_name=3": (make_sae(), {"format": "saelens", "hook_name": 3}, "hook_name"),
        "extra not JSON": (_unserialisable_lorsa(lorsa), {}, "JSON"),
    }.items():
        cases.append(Case(f"save/{label} over an existing checkpoint", "save", save_over(obj, **kw), needles=(needle,),
                          keep=keep_ckpt))
    return cases


def _unserialisable_lorsa(lorsa: Any) -> Any:
    import copy

    other = copy.deepcopy(lorsa)
    other.cfg.extra = {"bad": object()}
    return other


# ============================================================================ runner
def classify(case: Case, tmp: Path) -> Record:
    from nnsight_lorsa.errors import LorsaError

    before = _state(case.model) if case.model is not None else None
    kept = case.keep(tmp) if case.keep is not None else {}
    outcome, detail = "", ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = case.run(tmp)
    except Exception as e:  # noqa: BLE001 — classifying every exception is the point
        msg = str(e)
        if case.expect_raise is not None and type(e) is case.expect_raise:
            missing = [n for n in case.needles if n not in msg]
            outcome = "unclear_error" if missing else "correct"
            detail = f"raised {type(e).__name__} (expected): {msg[:200]}"
        elif isinstance(e, LorsaError):
            missing = [n for n in case.needles
                       if not any(alt.lower() in msg.lower() for alt in ((n,) if isinstance(n, str) else n))]
            outcome = "unclear_error" if missing else "named_error"
            detail = f"{type(e).__name__}: {msg[:300]}" + (f"  [does not name {missing}]" if missing else "")
        else:
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "nnsight_lorsa" in f.filename),
                         "")
            outcome, detail = "raw_exception", f"{type(e).__name__}: {msg[:300]} (at {where})"
    else:
        try:
            good = case.check is not None and bool(case.check(result))
        except Exception as e:  # noqa: BLE001
            good, detail = False, f"check raised {type(e).__name__}: {e}"
        outcome = "correct" if good else "silent_wrong"
        detail = detail or f"returned {type(result).__name__}"
    if before is not None and _state(case.model) != before:
        outcome, detail = "state_left", f"model modules/hooks changed ({outcome}: {detail})"
    for path, data in kept.items():
        if not path.is_file() or path.read_bytes() != data:
            outcome, detail = "data_lost", f"{path.name} changed or removed ({detail})"
    return Record(case.id, case.group, outcome, detail)


def all_cases(root: Path) -> list[Case]:
    fixtures = build_fixtures(root / "fixtures")
    from nnsight_lorsa.formats import load

    refs = {name: load(path) for name, path in fixtures.items()}
    return (loader_cases(fixtures, refs) + graph_cases(root / "fixtures") + gate_cases(root / "fixtures")
            + api_cases(root))


def run_all(only: str | None = None) -> list[Record]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    records = []
    with tempfile.TemporaryDirectory() as tmp_root:
        root = Path(tmp_root)
        for i, case in enumerate(all_cases(root)):
            if only and only not in case.id:
                continue
            case_dir = root / f"case{i}"
            case_dir.mkdir()
            records.append(classify(case, case_dir))
            shutil.rmtree(case_dir, ignore_errors=True)
    return records


def table(records: list[Record]) -> str:
    counts = Counter(r.outcome for r in records)
    groups = Counter(r.group.split(":")[0] for r in records)
    lines = [f"{len(records)} cases", "", "| outcome | cases |", "|---|---|"]
    lines += [f"| {o} | {counts.get(o, 0)} |" for o in OUTCOMES]
    lines += ["", "| input class | cases |", "|---|---|"] + [f"| {g} | {n} |" for g, n in sorted(groups.items())]
    bad = [r for r in records if r.outcome not in PASS]
    if bad:
        lines += ["", "not passing:"] + [f"  {r.outcome:14s} {r.id}: {r.detail}" for r in bad]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    records = run_all(only)
    if "--json" in argv:
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps([r.__dict__ for r in records], indent=1))
    print(table(records))
    return 0 if all(r.outcome in PASS for r in records) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
