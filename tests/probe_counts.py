"""Generated-input probe of the primitives, patching and analysis (issue 23): hypothesis draws arguments for
public entry points and every call is classified by what a user would see.

Support module of ``tests/test_generated_misuse.py`` (which runs it once, in a fresh interpreter without the
test-time type-checking hook, as ``tests/test_hostile.py`` runs the hand-made table) and a script that prints
the counts per outcome class::

    PYTHONPATH=. python tests/probe_counts.py                   # counts + every failing example
    PYTHONPATH=. python tests/probe_counts.py --examples 60     # more examples per probe (default 25)
    PYTHONPATH=. python tests/probe_counts.py --json F          # all records as JSON

Examples are derandomized (the same draws on every run) unless ``--explore`` is given. Each probe has a
*specification* written here, independently of the code under test: for the drawn arguments, either the call
must succeed with a result that passes a check (shape, finiteness, equality to a reference) or it must be
refused. Outcomes:

``correct``        valid arguments, the result passes the check;
``named_error``    invalid arguments refused by a :class:`~nnsight_lorsa.errors.LorsaError` naming the argument;
``unclear_error``  refused by one of ours whose message does not name the argument;
``false_refusal``  valid arguments refused by one of ours;
``silent_wrong``   invalid arguments accepted, or valid ones giving a result that fails the check;
``raw_exception``  a third-party or built-in exception (``RuntimeError``, ``IndexError``, ``TypeError`` …).

Only the first two pass.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

PASS = ("correct", "named_error")
OUTCOMES = ("correct", "named_error", "unclear_error", "false_refusal", "silent_wrong", "raw_exception")


@dataclass
class Ok:
    """The call must succeed and ``check(result)`` hold."""

    check: Callable[[Any], bool] = lambda r: True


@dataclass
class Err:
    """The call must raise one of ours whose message contains one of ``needles`` (case-insensitive)."""

    needles: tuple[str, ...]


@dataclass
class Probe:
    id: str
    group: str
    args: st.SearchStrategy
    run: Callable[[dict], Any]
    spec: Callable[[dict], Ok | Err]


@dataclass
class Record:
    probe: str
    group: str
    outcome: str
    args: str
    detail: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def classify(probe: Probe, args: dict) -> Record:
    from nnsight_lorsa.errors import LorsaError

    def rec(outcome: str, detail: str = "") -> Record:
        return Record(probe.id, probe.group, outcome, _short(args), detail)

    try:
        expect = probe.spec(args)
    except Exception as e:  # a bug of the probe itself
        return rec("raw_exception", f"spec failed: {type(e).__name__}: {e}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = probe.run(args)
    except LorsaError as e:
        if isinstance(expect, Ok):
            return rec("false_refusal", f"{type(e).__name__}: {e}")
        msg = str(e).lower()
        if any(n.lower() in msg for n in expect.needles):
            return rec("named_error", type(e).__name__)
        return rec("unclear_error", f"{type(e).__name__}: {e} (wanted one of {expect.needles})")
    except Exception as e:  # noqa: BLE001 - the class under count
        return rec("raw_exception", f"{type(e).__name__}: {str(e)[:200]}")
    if isinstance(expect, Err):
        return rec("silent_wrong", f"accepted (wanted an error naming one of {expect.needles})")
    try:
        good = bool(expect.check(result))
    except Exception as e:  # noqa: BLE001
        good, e_ = False, e
        return rec("silent_wrong", f"check raised {type(e_).__name__}: {e_}")
    return rec("correct") if good else rec("silent_wrong", f"result fails the check: {_short(result)}")


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}:{x.dtype}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={_short(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)) and len(x) > 6:
        return f"{type(x).__name__}[{len(x)}]"
    if isinstance(x, (list, tuple)):
        return type(x).__name__ + "(" + ", ".join(_short(v) for v in x) + ")"
    r = repr(x)
    return r if len(r) < 80 else r[:77] + "..."


# ============================================================================ value strategies
def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_posint(v: Any) -> bool:
    return is_int(v) and v > 0


def is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_posfinite(v: Any) -> bool:
    return is_real(v) and math.isfinite(v) and v > 0


JUNK = st.one_of(st.booleans(), st.none(), st.text(max_size=2), st.floats(allow_nan=True, allow_infinity=True),
                 st.integers(-3, 0), st.just([1]), st.just({"a": 1}), st.just(2.5))


_VALID: dict[int, tuple[st.SearchStrategy, st.SearchStrategy]] = {}


def hostile(valid: st.SearchStrategy, weight: int = 4) -> st.SearchStrategy:
    """Mostly ``valid`` values, sometimes junk (as a field of :func:`mutated`: ``valid``, corrupted there)."""
    s = st.one_of(*([valid] * weight), JUNK)
    _VALID[id(s)] = (s, valid)
    return s


def faulty(valid: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """A field of :func:`mutated` whose faults are ``bad`` (not :data:`JUNK`)."""
    s = st.one_of(valid, bad)
    _VALID[id(s)] = (s, valid)
    return s


def mutated(fields: dict[str, st.SearchStrategy], focus: tuple[str, ...] = ()) -> st.SearchStrategy:
    """Argument dicts: every field drawn valid, then 0, 1 or 2 of the :func:`hostile` fields replaced by junk
    (so that valid combinations, single faults and pairs of faults are all drawn)."""
    base = {k: _VALID[id(v)][1] if id(v) in _VALID else v for k, v in fields.items()}
    names = sorted(k for k, v in fields.items() if id(v) in _VALID) + [k for k in focus for _ in range(4)]

    @st.composite
    def draw(d: Any) -> dict:
        args = d(st.fixed_dictionaries(base))
        n = min(len(names), d(st.sampled_from([0, 0, 1, 1, 1, 2])))
        for name in d(st.lists(st.sampled_from(names or [""]), min_size=n, max_size=n, unique=True)):
            args[name] = d(fields[name])
        return args
    return draw()


def finite(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and bool(torch.isfinite(x).all())


# ============================================================================ configs
def _lorsa_cfg_valid(a: dict) -> Ok | Err:
    bad = [n for n in ("d_model", "n_qk_heads", "d_qk_head", "n_ov_heads", "top_k") if not is_posint(a[n])]
    bad += [n for n in ("qk_norm", "use_decoder_bias") if not isinstance(a[n], bool)]
    if not (a["attn_scale"] is None or is_posfinite(a["attn_scale"])):
        bad.append("attn_scale")
    if not is_posfinite(a["qk_norm_eps"]):
        bad.append("qk_norm_eps")
    if not (a["layer"] is None or (is_int(a["layer"]) and a["layer"] >= 0)):
        bad.append("layer")
    if bad:
        return Err(tuple(bad))
    if a["n_ov_heads"] % a["n_qk_heads"]:
        return Err(("multiple",))
    if a["top_k"] > a["n_ov_heads"]:
        return Err(("top_k",))
    return Ok(lambda cfg: cfg.group_size * cfg.n_qk_heads == a["n_ov_heads"] and cfg.scale > 0)


def config_probes() -> list[Probe]:
    from nnsight_lorsa.modules import CLTConfig, LorsaConfig, RotaryConfig, SAEConfig, TranscoderConfig
    from nnsight_lorsa.modules.activations import make_activation

    small = st.integers(1, 12)
    lorsa_args = mutated({
        "d_model": hostile(small), "n_qk_heads": hostile(st.sampled_from([1, 2, 2, 3])),
        "d_qk_head": hostile(st.sampled_from([2, 4])), "n_ov_heads": hostile(st.sampled_from([2, 4, 6, 8])),
        "top_k": hostile(st.integers(1, 6)), "attn_scale": hostile(st.one_of(st.none(), st.floats(0.1, 10))),
        "qk_norm": hostile(st.booleans()), "use_decoder_bias": hostile(st.booleans()),
        "qk_norm_eps": hostile(st.floats(1e-8, 1e-3)), "layer": hostile(st.one_of(st.none(), st.integers(0, 40))),
    })
    rotary_args = mutated({
        "head_dim": hostile(st.sampled_from([2, 4, 8])), "rotary_dim": hostile(st.sampled_from([2, 4, 8])),
        "base": hostile(st.floats(10, 1e5)), "interleaved": hostile(st.booleans()),
        "rope_type": hostile(st.sampled_from(["default", "linear"])),
        "scaling": hostile(st.sampled_from([{}, {"factor": 2.0}])),
    })

    def rotary_spec(a: dict) -> Ok | Err:
        bad = [n for n in ("head_dim", "rotary_dim") if not is_posint(a[n])]
        bad += ["base"] if not is_posfinite(a["base"]) else []
        bad += ["interleaved"] if not isinstance(a["interleaved"], bool) else []
        bad += ["rope_type"] if a["rope_type"] not in ("default", "linear") else []
        bad += ["scaling"] if not isinstance(a["scaling"], dict) else []
        if bad:
            return Err((*bad, "rotary_dim"))
        if a["rotary_dim"] > a["head_dim"] or a["rotary_dim"] % 2:
            return Err(("rotary_dim",))
        if a["rope_type"] == "linear" and "factor" not in a["scaling"]:
            return Err(("factor",))
        return Ok(lambda cs: finite(cs[0]) and finite(cs[1]) and cs[0].shape[-1] == a["rotary_dim"])

    def run_rotary(a: dict) -> Any:
        from nnsight_lorsa.modules.rotary import rotary_cos_sin

        cfg = RotaryConfig(**a)
        return rotary_cos_sin(cfg, torch.arange(5, device="cpu"))

    names = ["relu", "topk", "batchtopk", "jumprelu", "abstopk", "groupmax"]
    k = st.integers(1, 4)
    valid_params = {
        "relu": st.just({}), "topk": st.fixed_dictionaries({"k": k}), "abstopk": st.fixed_dictionaries({"k": k}),
        "batchtopk": st.fixed_dictionaries({"k": k}, optional={"threshold_lr": st.floats(1e-3, 0.5)}),
        "jumprelu": st.fixed_dictionaries({}, optional={"threshold": st.floats(0, 1),
                                                        "bandwidth": st.floats(1e-4, 0.1)}),
        "groupmax": st.fixed_dictionaries({"k": st.sampled_from([1, 2, 4])})}
    act_valid = st.sampled_from(names).flatmap(lambda n: valid_params[n].map(lambda p: (n, p)))
    act_bad = st.one_of(
        st.tuples(st.sampled_from(names), st.one_of(
            st.fixed_dictionaries({"k": st.one_of(JUNK, st.integers(5, 20))}),
            st.fixed_dictionaries({"k": st.just(2), "threshold_lr": st.one_of(JUNK, st.floats(1.5, 9))}),
            st.fixed_dictionaries({"threshold": st.one_of(JUNK, st.just(float("nan")))}),
            st.fixed_dictionaries({"bandwidth": st.one_of(JUNK, st.just(float("inf")))}), JUNK)),
        st.tuples(st.one_of(JUNK, st.just("gelu")), st.just({})))
    coder_args = mutated({
        "kind": st.sampled_from(["sae", "transcoder", "clt"]), "d_in": hostile(st.integers(1, 8)),
        "d_sae": hostile(st.sampled_from([4, 8, 12])), "act": faulty(act_valid, act_bad),
        "d_out": hostile(st.one_of(st.none(), st.integers(1, 8))),
        "layer": hostile(st.one_of(st.none(), st.integers(0, 30))), "n_layers": hostile(st.integers(1, 3)),
        "skip": hostile(st.booleans()), "apply_b_dec_to_input": hostile(st.booleans()),
        "normalize_activations": hostile(st.sampled_from(["none", "constant_norm_rescale", "layer_norm"]))},
        focus=("act", "layer")).map(
        lambda a: {**{k: v for k, v in a.items() if k != "act"}, "activation": a["act"][0],
                   "activation_params": a["act"][1]})

    ALLOWED = {"relu": set(), "topk": {"k"}, "batchtopk": {"k", "threshold_lr"},
               "jumprelu": {"threshold", "bandwidth"}, "abstopk": {"k"}, "groupmax": {"k"}}
    NEEDED = {"topk": {"k"}, "batchtopk": {"k"}, "abstopk": {"k"}, "groupmax": {"k"}}

    def coder_spec(a: dict) -> Ok | Err:
        kind = a["kind"]
        bad = [n for n in ("d_in", "d_sae") if not is_posint(a[n])]
        if kind == "transcoder":
            bad += ["d_out"] if not (a["d_out"] is None or is_posint(a["d_out"])) else []
            bad += ["layer"] if not (a["layer"] is None or (is_int(a["layer"]) and a["layer"] >= 0)) else []
        if kind == "clt":
            bad += ["n_layers"] if not is_posint(a["n_layers"]) else []
            bad += ["skip"] if not isinstance(a["skip"], bool) else []
        if kind == "sae":
            bad += ["apply_b_dec_to_input"] if not isinstance(a["apply_b_dec_to_input"], bool) else []
            bad += ["normalize_activations"] if a["normalize_activations"] not in (
                "none", "constant_norm_rescale", "layer_norm") else []
        p, name = a["activation_params"], a["activation"]
        d_sae = a["d_sae"] if is_posint(a["d_sae"]) else 10**9
        if not isinstance(name, str) or name not in ALLOWED:
            bad.append("activation")
        elif not isinstance(p, dict):
            bad.append("activation_params")
        else:
            extra = set(p) - ALLOWED[name]
            missing = NEEDED.get(name, set()) - set(p)
            if extra or missing:
                bad += [*sorted(extra | missing), "activation_params", "parameters"]
            k = p.get("k")
            if "k" in p and not (is_posint(k) and k <= d_sae and (name != "groupmax" or d_sae % k == 0)):
                bad.append("k")
            if "threshold" in p and not (is_real(p["threshold"]) and math.isfinite(p["threshold"])):
                bad.append("threshold")
            if "bandwidth" in p and not is_posfinite(p["bandwidth"]):
                bad.append("bandwidth")
            if "threshold_lr" in p and not (is_real(p["threshold_lr"]) and 0 <= p["threshold_lr"] <= 1):
                bad.append("threshold_lr")
        if bad:
            return Err(tuple(bad))
        return Ok(lambda cfg: cfg.d_sae == a["d_sae"])

    def run_coder(a: dict) -> Any:
        common = {"d_in": a["d_in"], "d_sae": a["d_sae"], "activation": a["activation"],
                  "activation_params": a["activation_params"]}
        if a["kind"] == "sae":
            return SAEConfig(**common, apply_b_dec_to_input=a["apply_b_dec_to_input"],
                             normalize_activations=a["normalize_activations"])
        if a["kind"] == "transcoder":
            return TranscoderConfig(**common, d_out=a["d_out"], layer=a["layer"])
        return CLTConfig(**common, n_layers=a["n_layers"], skip=a["skip"])

    def run_coder_then_activation(a: dict) -> Any:
        cfg = run_coder(a)  # the config must refuse what the activation would refuse later
        make_activation(cfg.activation, cfg.d_sae, cfg.activation_params)
        return cfg

    return [
        Probe("LorsaConfig(**fields)", "config", lorsa_args, lambda a: LorsaConfig(**a), _lorsa_cfg_valid),
        Probe("RotaryConfig(**fields) + cos/sin", "config", rotary_args, run_rotary, rotary_spec),
        Probe("SAE/Transcoder/CLTConfig(**fields)", "config", coder_args, run_coder_then_activation, coder_spec),
    ]


# ============================================================================ module forwards
D, NQK, DQK, NOV, TOPK = 8, 2, 4, 8, 2
FLOATS = [torch.float32]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool]


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, nan: bool = False) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(sum(shape) + 7)
    t = torch.randn(tuple(shape), generator=g, device="cpu")
    if nan and t.numel():
        t.view(-1)[0] = float("nan")
    return t.to(dtype)


def shapes(valid: tuple[int, ...], dims: list[int]) -> st.SearchStrategy:
    """Mostly the valid shape (batch / pos drawn from ``dims``), else any rank 0..4."""
    def fill(v: int | None) -> st.SearchStrategy:
        return st.sampled_from(dims) if v is None else st.sampled_from([v, v, v, 1, 3])
    good = st.tuples(*(fill(v) for v in valid))
    return st.one_of(good, good, good, st.lists(st.sampled_from([0, 1, 2, D]), max_size=4).map(tuple))


def module_probes() -> list[Probe]:
    from nnsight_lorsa.modules import (
        CLTConfig,
        CrossLayerTranscoder,
        Lorsa,
        LorsaConfig,
        RotaryConfig,
        SAEConfig,
        SkipTranscoder,
        SparseAutoencoder,
        TranscoderConfig,
    )

    torch.manual_seed(0)
    lorsa = Lorsa(LorsaConfig(d_model=D, n_qk_heads=NQK, d_qk_head=DQK, n_ov_heads=NOV, top_k=TOPK,
                              rotary=RotaryConfig(DQK, DQK), qk_norm=True)).eval()
    coders = {
        "sae_topk": SparseAutoencoder(SAEConfig(d_in=D, d_sae=12, activation="topk", activation_params={"k": 3})),
        "sae_jumprelu": SparseAutoencoder(SAEConfig(d_in=D, d_sae=12, activation="jumprelu")),
        "sae_layernorm": SparseAutoencoder(SAEConfig(d_in=D, d_sae=12, normalize_activations="layer_norm")),
        "skip_tc": SkipTranscoder(TranscoderConfig(d_in=D, d_sae=12, d_out=5, activation="batchtopk",
                                                   activation_params={"k": 2})),
    }
    clt = CrossLayerTranscoder(CLTConfig(d_in=D, d_sae=6, n_layers=2, skip=True, activation="relu"))
    for m in [*coders.values(), clt]:
        m.eval()

    def x_ok(shape: tuple, dtype: torch.dtype, rank: int | None, width: int) -> bool:
        return ((rank is None and len(shape) >= 2) or len(shape) == rank) and shape[-1] == width and dtype in FLOATS

    # ---- Lorsa.forward(x, positions, attn_mask, top_k)
    lorsa_args = mutated({
        "shape": faulty(st.tuples(st.integers(1, 3), st.integers(1, 4), st.just(D)),
                        st.sampled_from([(), (D,), (2, D), (0, 0, D), (2, 0, D), (0, 3, D), (2, 3, D + 1),
                                         (1, 2, 3, D)])),
        "dtype": faulty(st.just(torch.float32), st.sampled_from(DTYPES[1:])), "nan": st.booleans(),
        "positions": faulty(st.sampled_from(["none", "ok", "2d"]), st.sampled_from(["wrong_len", "float"])),
        "mask": faulty(st.sampled_from(["none", "ok2d", "ok4d", "float4d"]),
                       st.sampled_from(["wrong_keys", "wrong_batch"])),
        "top_k": faulty(st.one_of(st.none(), st.integers(1, NOV)), st.sampled_from([-1, 0, NOV + 1, True, 1.5, "2"]))})

    def lorsa_spec(a: dict) -> Ok | Err:
        s, dt = a["shape"], a["dtype"]
        if not x_ok(s, dt, 3, D):
            return Err(("x", "shape", "dtype"))
        b, p = s[0], s[1]
        if a["positions"] in ("wrong_len",) and p != 2:
            return Err(("positions",))
        if a["positions"] == "float":
            return Err(("positions",))
        if a["mask"] in ("wrong_keys",):
            return Err(("attn_mask",))
        if a["mask"] == "wrong_batch" and b != 2:
            return Err(("attn_mask",))
        k = a["top_k"]
        if k is not None and not (is_int(k) and 1 <= k <= NOV):
            return Err(("top_k",))

        def check(out: Any) -> bool:
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (b, p, D) or out.dtype != dt:
                return False
            return a["nan"] or finite(out)
        return Ok(check)

    def lorsa_run(a: dict) -> Any:
        x = _tensor(a["shape"], a["dtype"], a["nan"])
        b = a["shape"][0] if a["shape"] else 1
        p = a["shape"][1] if len(a["shape"]) > 1 else 1
        positions = {"none": None, "ok": torch.arange(p, device="cpu"),
                     "2d": torch.arange(p, device="cpu").expand(max(b, 1), p),
                     "wrong_len": torch.arange(2, device="cpu"), "float": torch.arange(p, device="cpu") + 0.5}[
            a["positions"]]
        if a["positions"] == "2d" and b == 0:
            positions = torch.zeros(0, p, dtype=torch.long, device="cpu")
        mask = {"none": None, "ok2d": torch.ones(b, p, dtype=torch.long, device="cpu"),
                "ok4d": torch.ones(p, p, dtype=torch.bool, device="cpu").tril().expand(b, 1, p, p),
                "wrong_keys": torch.ones(b, p + 1, dtype=torch.long, device="cpu"),
                "wrong_batch": torch.ones(2, p, dtype=torch.long, device="cpu"),
                "float4d": torch.zeros(b, 1, p, p, device="cpu")}[a["mask"]] if len(a["shape"]) >= 2 else None
        return lorsa(x, positions, mask, top_k=a["top_k"])

    # ---- z_pattern / attention_pattern head indices
    head_list = st.one_of(st.lists(st.integers(-NOV - 1, NOV + 1), max_size=3), st.just([True]), st.just([1.5]),
                          st.just([[0, 1]]), st.just("0"), st.integers(-2, NOV + 1),
                          st.lists(st.integers(0, NOV - 1), min_size=1, max_size=3))

    def heads_spec(n: int, what: str) -> Callable[[dict], Ok | Err]:
        def spec(a: dict) -> Ok | Err:
            h = a["heads"]
            items = [h] if is_int(h) else h
            if not isinstance(items, list) or not all(is_int(i) and 0 <= i < n for i in items):
                return Err((what,))
            if not items:
                return Err((what,))
            return Ok(lambda out: tuple(out.shape) == (2, len(items), 3, 3) and finite(out))
        return spec

    x3 = _tensor((2, 3, D), torch.float32)

    # ---- sparse coders encode / decode / forward
    coder_args = mutated({
        "coder": st.sampled_from(sorted(coders)), "method": st.sampled_from(["forward", "encode", "decode"]),
        "shape": faulty(st.sampled_from([(2, 0), (3, 0), (2, 3, 0), (0, 0)]),
                        st.sampled_from([(), (0,), (1, 2, 3, 4, 0)])),
        "width": faulty(st.just("in"), st.sampled_from(["sae", "other"])),
        "dtype": faulty(st.just(torch.float32), st.sampled_from(DTYPES[1:])), "nan": st.booleans()})

    def coder_width(a: dict) -> int:
        c = coders[a["coder"]]
        return {"in": c.d_in if a["method"] != "decode" else c.d_sae, "sae": c.d_sae, "other": 5 + 2}[a["width"]]

    def coder_spec(a: dict) -> Ok | Err:
        c = coders[a["coder"]]
        w = coder_width(a)
        shape = (*a["shape"][:-1], w) if a["shape"] else (w,)
        want = c.d_sae if a["method"] == "decode" else c.d_in
        if not x_ok(shape, a["dtype"], None, want):
            return Err(("x", "acts", "shape", "dtype"))
        out_w = {"forward": c.d_out, "encode": c.d_sae, "decode": c.d_out}[a["method"]]

        def check(out: Any) -> bool:
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (*shape[:-1], out_w):
                return False
            if a["nan"] or (a["coder"] == "sae_layernorm" and a["method"] != "decode"):
                return True  # layer_norm: NaN where a row is constant (documented)
            return finite(out)
        return Ok(check)

    def coder_run(a: dict) -> Any:
        w = coder_width(a)
        shape = (*a["shape"][:-1], w) if a["shape"] else (w,)
        return getattr(coders[a["coder"]], a["method"])(_tensor(shape, a["dtype"], a["nan"]))

    # ---- CLT per layer
    clt_args = mutated({
        "layer": hostile(st.integers(0, 1)), "n_acts": faulty(st.just(2), st.integers(0, 1)),
        "acts_width": faulty(st.just(6), st.just(5)),
        "x": faulty(st.just("ok"), st.sampled_from(["none", "wrong_width"])),
        "batch": st.sampled_from([(2,), (2, 3), ()])})

    def clt_spec(a: dict) -> Ok | Err:
        layer = a["layer"]
        if not (is_int(layer) and 0 <= layer < 2):
            return Err(("layer",))
        if a["n_acts"] <= layer:
            return Err(("features", "acts"))
        if a["acts_width"] != 6:
            return Err(("acts",))
        if a["x"] != "ok":
            return Err(("x",))
        return Ok(lambda out: tuple(out.shape) == (*a["batch"], D) and finite(out))

    def clt_run(a: dict) -> Any:
        acts = [_tensor((*a["batch"], a["acts_width"]), torch.float32).relu() for _ in range(a["n_acts"])]
        x = {"ok": _tensor((*a["batch"], D), torch.float32), "none": None,
             "wrong_width": _tensor((*a["batch"], D + 1), torch.float32)}[a["x"]]
        return clt.reconstruct_layer(acts, a["layer"], x)

    # ---- decoding: forward_step(x, past) and LorsaKV.crop
    from nnsight_lorsa.modules.lorsa import LorsaKV

    full = _tensor((2, 4, D), torch.float32)
    _, kv3 = lorsa.forward_step(full[:, :3])
    step_args = mutated({"past": faulty(st.just("ok"), st.sampled_from(["k_heads", "v_width", "lengths", "batch",
                                                                         "not_kv"])),
                         "crop": hostile(st.integers(0, 3)) | st.integers(-3, 6)})

    def step_spec(a: dict) -> Ok | Err:
        c = a["crop"]
        bad = [] if is_int(c) and 0 <= c <= 3 else ["crop", "length"]
        # cropping to <= 2 positions makes the "lengths" fault (k 3 positions, v 2) consistent again
        fits = a["past"] == "ok" or (a["past"] == "lengths" and is_int(c) and 0 <= c <= 2)
        bad += [] if fits else ["past", "lorsakv"]
        if bad:
            return Err(tuple(bad))
        with torch.no_grad():
            ref = lorsa(full[:, :c + 1])[:, -1:]
        return Ok(lambda out: tuple(out.shape) == (2, 1, D) and bool(torch.allclose(out, ref, atol=1e-5)))

    def step_run(a: dict) -> Any:
        past = kv3
        past = {"ok": past, "k_heads": LorsaKV(past.k[:, :1], past.v), "v_width": LorsaKV(past.k, past.v[..., :3]),
                "lengths": LorsaKV(past.k, past.v[:, :2]), "batch": LorsaKV(past.k[:1], past.v[:1]),
                "not_kv": "x"}[a["past"]]
        if isinstance(past, LorsaKV):
            past = past.crop(a["crop"])
        x = full[:, a["crop"]:a["crop"] + 1] if is_int(a["crop"]) and 0 <= a["crop"] <= 3 else full[:, 3:]
        with torch.no_grad():
            return lorsa.forward_step(x, past=past)[0]

    return [
        Probe("Lorsa.forward_step(x, past) + LorsaKV.crop(length)", "forward", step_args, step_run, step_spec),
        Probe("Lorsa.forward(x, positions, attn_mask, top_k)", "forward", lorsa_args, lorsa_run, lorsa_spec),
        Probe("Lorsa.z_pattern(x, ov_heads)", "forward", st.fixed_dictionaries({"heads": head_list}),
              lambda a: lorsa.z_pattern(x3, a["heads"]), heads_spec(NOV, "ov_heads")),
        Probe("Lorsa.attention_pattern(x, qk_heads)", "forward", st.fixed_dictionaries({"heads": head_list}),
              lambda a: lorsa.attention_pattern(x3, a["heads"]), heads_spec(NQK, "qk_heads")),
        Probe("SparseCoder.encode/decode/forward(x)", "forward", coder_args, coder_run, coder_spec),
        Probe("CrossLayerTranscoder.reconstruct_layer(acts, layer, x)", "forward", clt_args, clt_run, clt_spec),
    ]


# ============================================================================ analysis
def analysis_probes() -> list[Probe]:
    from nnsight_lorsa.analysis import TopActivations

    args = mutated({
        "n_heads": hostile(st.integers(1, 4)), "n_top": hostile(st.integers(1, 4)),
        "z_shape": faulty(st.sampled_from([(2, 3, None), (0, 3, None), (2, 0, None)]),
                          st.sampled_from([(6, None), (2, 3, 9)])),
        "nan": faulty(st.just(False), st.just(True)), "first_window": hostile(st.integers(0, 5)),
        "keep": faulty(st.sampled_from(["none", "ok"]), st.just("wrong_shape")), "top": hostile(st.integers(0, 5))})

    def spec(a: dict) -> Ok | Err:
        bad = [n for n in ("n_heads", "n_top") if not is_posint(a[n])]
        if bad:
            return Err(tuple(bad))
        n = a["n_heads"]
        shape = tuple(n if v is None else v for v in a["z_shape"])
        if len(shape) != 3 or shape[-1] != n:
            return Err(("z",))
        if not (is_int(a["first_window"]) and a["first_window"] >= 0):
            return Err(("first_window",))
        if a["keep"] == "wrong_shape":
            return Err(("keep",))
        if a["nan"] and shape[0] * shape[1]:
            return Err(("z", "nan", "finite"))
        if not (is_int(a["top"]) and a["top"] >= 0):
            return Err(("n",))

        def check(out: Any) -> bool:
            t, heads = out
            ok_vals = bool(((t.values == float("-inf")) | torch.isfinite(t.values)).all())
            return (tuple(t.values.shape) == (n, a["n_top"]) and ok_vals and len(heads) <= min(a["top"], n)
                    and all(0 <= h < n for h in heads) and int(t.window.max()) < a["first_window"] + max(shape[0], 1))
        return Ok(check)

    def run(a: dict) -> Any:
        t = TopActivations.empty(a["n_heads"], a["n_top"])
        n = a["n_heads"] if is_int(a["n_heads"]) else 1
        shape = tuple(n if v is None else v for v in a["z_shape"])
        z = _tensor(shape, torch.float32, a["nan"])
        keep = None if a["keep"] == "none" else torch.ones(
            shape[:2] if a["keep"] == "ok" else (7,), dtype=torch.bool, device="cpu")
        t.update(z, a["first_window"], keep)
        return t, t.top_heads(a["top"])

    return [Probe("TopActivations.empty/update/top_heads", "analysis", args, run, spec)]


# ============================================================================ patching (tiny model)
def patching_probes() -> list[Probe]:
    import nnsight
    from helpers import LAYER, make_lorsa, make_sae, make_transcoder, random_ids, tiny_nnsight

    from nnsight_lorsa import LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
    from nnsight_lorsa.analysis import collect_top_activations, ov_feature_cosines, ov_logit_lens
    from nnsight_lorsa.patching import (
        Feature,
        LorsaHead,
        MHSAHead,
        TaskBatch,
        ablate,
        ablation_effect,
        circuit_size,
        head_swap,
        logit_difference,
        mean_activations,
        path_patching,
        random_ablation_control,
        relative_effect,
        scale,
        steer,
    )

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter)
    site = adapter.attention_norm_path(LAYER)
    r = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}),
                         transcoders=TranscoderSet(model, {0: make_transcoder()}),
                         saes=SAESet(model, {site: make_sae()}))
    n_ov = lorsa.cfg.n_ov_heads
    SEQ = 6
    ids = random_ids(2, SEQ)
    with torch.no_grad():
        ref_logits = hf(ids).logits
    idx = hostile(st.integers(-3, 20))

    # ---- target validation (no model run)
    target_args = mutated({
        "kind": st.sampled_from(["mhsa", "lorsa", "sae", "transcoder"]), "layer": idx,
        "head": hostile(st.integers(-3, 140)),
        "site": st.sampled_from([site, "model.layers.9", 0, 1, True, None])})

    def target_spec(a: dict) -> Ok | Err:
        kind, layer, head = a["kind"], a["layer"], a["head"]
        if kind == "mhsa":
            if not (is_int(layer) and 0 <= layer < 3):
                return Err(("layer",))
            return Ok() if is_int(head) and 0 <= head < 4 else Err(("head", "index"))
        if kind == "lorsa":
            if not (is_int(layer) and layer == LAYER):
                return Err(("layer",))
            return Ok() if is_int(head) and 0 <= head < n_ov else Err(("head", "index"))
        want = site if kind == "sae" else 0
        if a["site"] != want or type(a["site"]) is not type(want):
            return Err(("site", "layer", "sae", "transcoder"))
        return Ok() if is_int(head) and 0 <= head < 128 else Err(("index", "feature"))

    def target_run(a: dict) -> Any:
        t = {"mhsa": lambda: MHSAHead(a["layer"], a["head"]), "lorsa": lambda: LorsaHead(a["layer"], a["head"]),
             "sae": lambda: Feature(a["site"], a["head"]),
             "transcoder": lambda: Feature(a["site"], a["head"], kind="transcoder")}[a["kind"]]()
        return r(t)

    # ---- interventions in a trace: positions, alpha, delta, means
    head_junk = st.one_of(st.lists(st.integers(-20, 80), max_size=3), st.just([True]), st.just([1.5]),
                          st.just("0"), st.integers(-3, 80), st.just([]))
    pos = st.one_of(st.none(), st.integers(-8, 8), st.lists(st.integers(-8, 8), max_size=3), st.just(True),
                    st.just(1.5), st.builds(slice, st.integers(-8, 8), st.integers(-8, 8)), st.just("1"))
    value = st.one_of(st.floats(-3, 3), st.floats(-3, 3), st.just(float("nan")), st.just(float("inf")),
                      st.just(True), st.just("2"), st.none(), st.sampled_from(["t_ok", "t_nan", "t_3d", "t_wrong"]))
    int_args = mutated({
        "op": st.sampled_from(["scale", "steer", "ablate_mean", "ablate_mode"]),
        "target": st.sampled_from(["mhsa", "lorsa", "sae"]),
        "positions": faulty(st.one_of(st.none(), st.integers(-SEQ, SEQ - 1), st.just([0, -1])), pos),
        "value": faulty(st.one_of(st.floats(-3, 3), st.just("t_ok"), st.just("zero")), value)})

    def positions_ok(p: Any) -> bool:
        if p is None:
            return True
        if is_int(p):
            return -SEQ <= p < SEQ
        if isinstance(p, slice):
            return len(range(SEQ)[p]) > 0
        if isinstance(p, list):
            return bool(p) and all(is_int(i) and -SEQ <= i < SEQ for i in p)
        return False

    def value_tensor(code: str, target: str) -> torch.Tensor:
        width = (16,) if target == "mhsa" else ()
        return {"t_ok": torch.full(width or (1,), 0.5, device="cpu").reshape(width),
                "t_nan": torch.full(width or (1,), float("nan"), device="cpu").reshape(width),
                "t_3d": torch.zeros(1, 1, 1, *width, device="cpu"), "t_wrong": torch.zeros(3, device="cpu")}[code]

    def int_spec(a: dict) -> Ok | Err:
        bad: list[str] = [] if positions_ok(a["positions"]) else ["positions"]
        v, op, p = a["value"], a["op"], a["positions"]
        name = {"scale": "alpha", "steer": "delta", "ablate_mean": "means", "ablate_mode": "mode"}[op]
        if op == "ablate_mode":
            bad += [] if is_real(v) or v == "zero" else ["mode"]
        elif isinstance(v, str) and v.startswith("t_"):
            t = value_tensor(v, a["target"])
            n_pos = None if is_int(p) else SEQ if p is None else len(range(SEQ)[p]) if isinstance(p, slice) else \
                len(p) if isinstance(p, list) else 1
            site = (2,) if n_pos is None else (2, n_pos)
            site = (*site, 16) if a["target"] == "mhsa" else site
            fits = len(t.shape) <= len(site) and all(
                h in (1, w) for h, w in zip(t.shape[::-1], site[::-1], strict=False))
            if a["target"] == "mhsa" and (t.dim() == 0 or t.shape[-1] != 16):
                fits = False
            if not fits:
                bad += [name, "values", "shape"]
            elif v == "t_nan":
                bad += [name]
        elif not (is_real(v) and math.isfinite(v)):
            bad.append(name)
        return Err(tuple(bad)) if bad else Ok(check_logits)

    def check_logits(out: Any) -> bool:
        return isinstance(out, torch.Tensor) and out.shape == ref_logits.shape and finite(out)

    targets = {"mhsa": MHSAHead(LAYER, 1), "lorsa": LorsaHead(LAYER, 3), "sae": Feature(site, 5)}

    def int_run(a: dict) -> Any:
        v = a["value"]
        if isinstance(v, str) and v.startswith("t_"):
            v = value_tensor(v, a["target"])
        b = r(targets[a["target"]])
        out = []
        with model.trace(ids):
            r.prepare([targets[a["target"]]])
            if a["op"] == "scale":
                scale(b, v, a["positions"])
            elif a["op"] == "steer":
                steer(b, v, a["positions"])
            elif a["op"] == "ablate_mean":
                ablate(b, "mean", v, a["positions"])
            else:
                ablate(b, "zero" if is_real(v) else v, None, a["positions"])
            out.append(nnsight.save(model.lm_head.output))
        return out[0]

    # ---- metrics
    metric_args = mutated({
        "correct": hostile(st.integers(-2, 140)), "incorrect": hostile(st.integers(0, 127)),
        "position": hostile(st.integers(-SEQ - 2, SEQ + 2))})

    def metric_spec(a: dict) -> Ok | Err:
        bad = [n for n in ("correct", "incorrect") if not (is_int(a[n]) and 0 <= a[n] < 128)]
        bad += ["position"] if not (is_int(a["position"]) and -SEQ <= a["position"] < SEQ) else []
        if bad:
            return Err(tuple(f"{b}_ids" if b != "position" else b for b in bad))
        return Ok(lambda out: tuple(out.shape) == (2,) and finite(out))

    rel_args = mutated({"baseline": hostile(st.floats(0.5, 3)), "intervened": hostile(st.floats(-3, 3))})

    def rel_spec(a: dict) -> Ok | Err:
        bad = [n for n in ("baseline", "intervened") if not (is_real(a[n]) and math.isfinite(a[n]))]
        if bad:
            return Err(tuple(bad))
        # documented: computed in fp32, refused where the baseline is 0 or rounding-sized there
        # (|b| <= 4 · eps32 · max(|b|, |i|)): a baseline that fp32 cannot hold (1e-177) is 0 to it
        b32, i32 = (abs(float(torch.tensor(float(a[n]), dtype=torch.float32))) for n in ("baseline", "intervened"))
        if b32 <= 4 * torch.finfo(torch.float32).eps * max(b32, i32):
            return Err(("the baseline and 0 are equal",))
        return Ok(lambda out: finite(out))

    rand_args = mutated({"k": hostile(st.integers(1, 3)), "n_samples": hostile(st.integers(1, 2)),
                                       "seed": hostile(st.integers(0, 3))})

    def rand_spec(a: dict) -> Ok | Err:
        bad = [n for n in ("k", "n_samples") if not (is_posint(a[n]) and (n != "k" or a[n] <= 3))]
        bad += ["seed"] if not is_int(a["seed"]) else []
        if bad:
            return Err(tuple(bad))
        return Ok(lambda res: tuple(res.samples.shape) == (a["n_samples"], 2) and finite(res.samples))

    pool = [LorsaHead(LAYER, h) for h in (0, 1, 2)]

    def rand_run(a: dict) -> Any:
        return random_ablation_control(r, ids, pool, a["k"], n_samples=a["n_samples"], seed=a["seed"],
                                       correct_ids=3, incorrect_ids=4)

    # ---- head_swap (a trace) and analysis on the model
    swap_args = mutated({"layer": hostile(st.just(LAYER)), "from_head": hostile(st.integers(0, n_ov - 1)),
                         "to_head": hostile(st.integers(0, n_ov - 1)),
                         "positions": faulty(st.one_of(st.integers(-SEQ, SEQ - 1), st.none()), pos)})

    def swap_spec(a: dict) -> Ok | Err:
        bad = [] if is_int(a["layer"]) and a["layer"] == LAYER else ["layer"]
        bad += [n for n in ("from_head", "to_head") if not (is_int(a[n]) and 0 <= a[n] < n_ov)]
        bad += [] if positions_ok(a["positions"]) else ["positions"]
        if bad:
            return Err((*bad, "head", "index"))
        return Ok(lambda out: all(tuple(o.shape) == tuple(ref_logits.shape) and finite(o) for o in out))

    lens_args = mutated({"heads": faulty(st.one_of(st.none(), st.lists(st.integers(0, n_ov - 1), min_size=1,
                                                                          max_size=3)), head_junk),
                         "k": hostile(st.integers(1, 5)) | st.just(10**4), "head": hostile(st.integers(0, n_ov - 1))})

    def lens_spec(a: dict) -> Ok | Err:
        h = a["heads"]
        items = None if h is None else [h] if is_int(h) else h
        bad = [] if items is None or (isinstance(items, list) and items and all(
            is_int(i) and 0 <= i < n_ov for i in items)) else ["heads"]
        bad += [] if is_int(a["k"]) and 1 <= a["k"] <= 128 else ["k"]
        bad += [] if is_int(a["head"]) and 0 <= a["head"] < n_ov else ["head"]
        if bad:
            return Err(tuple(bad))
        n = n_ov if items is None else len(items)
        return Ok(lambda out: tuple(out[0].shape) == (n, a["k"]) and finite(out[0])
                  and tuple(out[2]["o"][0].shape) == (min(a["k"], 5),))

    sae_rows = torch.randn(5, lorsa.cfg.d_model, device="cpu")

    def lens_run(a: dict) -> Any:
        vals, ids, _ = ov_logit_lens(r, LAYER, a["heads"], a["k"])
        return vals, ids, ov_feature_cosines(lorsa, a["head"], sae_out_encoder=sae_rows, k=a["k"])

    collect_args = mutated({"n_top": hostile(st.integers(1, 3)), "batch_size": hostile(st.integers(1, 3)),
                            "tokens": faulty(st.just("ok"), st.sampled_from(["float", "1d", "empty"]))})

    def collect_spec(a: dict) -> Ok | Err:
        bad = [n for n in ("n_top", "batch_size") if not is_posint(a[n])]
        bad += [] if a["tokens"] == "ok" else ["tokens"]
        if bad:
            return Err(tuple(bad))
        return Ok(lambda t: tuple(t.values.shape) == (n_ov, a["n_top"]) and t.n_tokens == 2 * (SEQ - 1))

    def collect_run(a: dict) -> Any:
        tokens = {"ok": ids, "float": ids.float(), "1d": ids[0], "empty": ids[:0]}[a["tokens"]]
        return collect_top_activations(r, LAYER, tokens, n_top=a["n_top"], batch_size=a["batch_size"])

    # ---- experiments: ablation_effect (metric, positions) and circuit_size (threshold, ks, scores)
    comps = [LorsaHead(LAYER, 1), MHSAHead(0, 1)]
    task = TaskBatch("probe", ids, ids.flip(1), torch.tensor([3, 4], device="cpu"),
                     torch.tensor([5, 6], device="cpu"))
    metrics = {"ids": None, "ok": lambda lg: lg[:, -1, 3] - lg[:, -1, 4], "str": lambda lg: "x",
               "logits": lambda lg: lg, "scalar": lambda lg: lg.sum(), "not_callable": 3}
    exp_args = mutated({
        "op": st.sampled_from(["ablation_effect", "circuit_size"]),
        "metric": faulty(st.sampled_from(["ids", "ok"]), st.sampled_from(["str", "logits", "scalar", "not_callable"])),
        "positions": faulty(st.one_of(st.none(), st.integers(-SEQ, SEQ - 1)), pos),
        "threshold": hostile(st.floats(0.1, 1.0)),
        "ks": faulty(st.one_of(st.none(), st.lists(st.integers(0, 2), max_size=2)),
                     st.one_of(st.just([True]), st.just([1.5]), st.just([5]), st.just("1"))),
        "scores": faulty(st.sampled_from(["none", "ok"]), st.just("nan"))})

    def exp_spec(a: dict) -> Ok | Err:
        bad = [] if a["metric"] in ("ids", "ok") else ["metric"]
        if a["op"] == "ablation_effect":
            bad += [] if positions_ok(a["positions"]) else ["positions"]
            if bad:
                return Err(tuple(bad))
            return Ok(lambda res: tuple(res.ablated.shape) == (2,) and finite(res.ablated) and finite(res.baseline))
        bad += [] if is_real(a["threshold"]) and math.isfinite(a["threshold"]) else ["threshold"]
        ks = a["ks"]
        bad += [] if ks is None or (isinstance(ks, list) and all(is_int(k) and 0 <= k <= 2 for k in ks)) else ["ks"]
        bad += ["scores"] if a["scores"] == "nan" else []
        if bad:
            return Err(tuple(bad))
        return Ok(lambda res: res.global_k in (0, 1, 2) and tuple(res.per_prompt_k.shape) == (2,))

    def exp_run(a: dict) -> Any:
        metric = metrics[a["metric"]]
        if a["op"] == "ablation_effect":
            return ablation_effect(r, ids, comps, metric=metric, correct_ids=3, incorrect_ids=4,
                                   positions=a["positions"])
        scores = {"none": None, "ok": torch.tensor([[1.0, 0.5], [0.2, 0.9]], device="cpu"),
                  "nan": torch.full((2, 2), float("nan"), device="cpu")}[a["scores"]]
        return circuit_size(r, task, comps, scores=scores, threshold=a["threshold"], ks=a["ks"], metric=metric)

    # ---- path_patching (senders, positions, freeze, groups_per_trace) and mean_activations(per_position)
    pp_args = mutated({
        "senders": faulty(st.sampled_from(["mhsa", "lorsa", "both"]), st.sampled_from(["none", "empty_group"])),
        "positions": faulty(st.one_of(st.none(), st.integers(-SEQ, SEQ - 1)), pos),
        "freeze": hostile(st.booleans()), "groups_per_trace": hostile(st.integers(1, 3)),
        "per_position": hostile(st.booleans())})
    senders = {"mhsa": [MHSAHead(0, 1)], "lorsa": [LorsaHead(LAYER, 2)], "both": [MHSAHead(0, 1), LorsaHead(LAYER, 2)],
               "none": [], "empty_group": [()]}

    def pp_spec(a: dict) -> Ok | Err:
        bad = [] if a["senders"] in ("mhsa", "lorsa", "both") else ["sender"]
        bad += [] if positions_ok(a["positions"]) else ["positions"]
        bad += [n for n in ("freeze", "per_position") if not isinstance(a[n], bool)]
        bad += [] if is_posint(a["groups_per_trace"]) else ["groups_per_trace"]
        if bad:
            return Err(tuple(bad))
        n = len(senders[a["senders"]])
        return Ok(lambda out: tuple(out[0].patched.shape) == (n, 2) and finite(out[0].patched) and len(out[1]) == n)

    def pp_run(a: dict) -> Any:
        res = path_patching(r, ids, senders[a["senders"]], corrupt=ids.flip(1), correct_ids=3, incorrect_ids=4,
                            positions=a["positions"], freeze=a["freeze"], groups_per_trace=a["groups_per_trace"])
        return res, mean_activations(r, senders[a["senders"]], ids, per_position=a["per_position"])

    return [
        Probe("path_patching(senders, positions, freeze, groups_per_trace) + mean_activations traces", "patching",
              pp_args, pp_run, pp_spec),
        Probe("ablation_effect(metric, positions) / circuit_size(threshold, ks, scores) traces", "patching",
              exp_args, exp_run, exp_spec),
        Probe("head_swap(layer, from_head, to_head, positions)", "patching", swap_args,
              lambda a: head_swap(r, a["layer"], a["from_head"], a["to_head"], ids, positions=a["positions"]),
              swap_spec),
        Probe("ov_logit_lens(heads, k) + ov_feature_cosines(head, k)", "analysis", lens_args, lens_run, lens_spec),
        Probe("collect_top_activations(tokens, n_top, batch_size)", "analysis", collect_args, collect_run,
              collect_spec),
        Probe("ReplacementModel(target) for MHSAHead/LorsaHead/Feature", "patching", target_args, target_run,
              target_spec),
        Probe("scale/steer/ablate(target, value, positions) in a trace", "patching", int_args, int_run, int_spec),
        Probe("logit_difference(logits, correct, incorrect, position)", "patching", metric_args,
              lambda a: logit_difference(ref_logits, a["correct"], a["incorrect"], a["position"]), metric_spec),
        Probe("relative_effect(baseline, intervened)", "patching", rel_args,
              lambda a: relative_effect(a["baseline"], a["intervened"]), rel_spec),
        Probe("random_ablation_control(k, n_samples, seed)", "patching", rand_args, rand_run, rand_spec),
    ]


# ============================================================================ task builders
def task_probes() -> list[Probe]:
    from helpers import tiny_tokenizer

    from nnsight_lorsa.patching import induction_task

    tok = tiny_tokenizer()
    vocab = len(tok)
    special = set(tok.all_special_ids)
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    args = mutated({"n_prompts": hostile(st.integers(1, 4)), "seq_len": hostile(st.integers(2, 8)),
                    "seed": hostile(st.integers(0, 9)),
                    "token_pool": faulty(st.one_of(st.none(), st.lists(st.integers(0, vocab - 1), min_size=12,
                                                                        max_size=20)),
                                         st.one_of(st.lists(st.integers(vocab, vocab + 50), min_size=12, max_size=12),
                                                   st.just([-1] * 12), st.just([1.5] * 12), st.just([3] * 12)))})

    def spec(a: dict) -> Ok | Err:
        bad = [] if is_posint(a["n_prompts"]) else ["n_prompts"]
        bad += [] if is_int(a["seq_len"]) and a["seq_len"] >= 2 else ["seq_len"]
        bad += [] if is_int(a["seed"]) else ["seed"]
        pool = a["token_pool"]
        if pool is not None and not all(is_int(t) and 0 <= t < vocab for t in pool):
            bad.append("token_pool")
        if bad:
            return Err(tuple(bad))
        n_distinct = len(set(range(vocab) if pool is None else pool) - special)
        if n_distinct < a["seq_len"] + 1:
            return Err(("distinct tokens", "pool"))
        n, L, b = a["n_prompts"], a["seq_len"], len(bos)

        def check(t: Any) -> bool:
            shape = (n, b + 2 * L - 1)
            repeats = bool((t.clean[:, b + L:] == t.clean[:, b:b + L - 1]).all())
            return (tuple(t.clean.shape) == shape and tuple(t.corrupt.shape) == shape and repeats
                    and int(t.clean.min()) >= 0 and int(t.clean.max()) < vocab and int(t.corrupt.max()) < vocab)
        return Ok(check)

    def run(a: dict) -> Any:
        return induction_task(tok, a["n_prompts"], a["seq_len"], seed=a["seed"], token_pool=a["token_pool"])

    return [Probe("induction_task(n_prompts, seq_len, seed, token_pool)", "patching", args, run, spec)]


# ============================================================================ driver
def all_probes() -> list[Probe]:
    return [*config_probes(), *module_probes(), *analysis_probes(), *task_probes(), *patching_probes()]


def _run_probe(probe: Probe, n: int, derandomize: bool, records: list[Record]) -> None:
    @settings(max_examples=n, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(probe.args)
    def body(args: dict) -> None:
        records.append(classify(probe, args))

    body()


def run_all(examples: int = 25, derandomize: bool = True, only: str | None = None) -> list[Record]:
    records: list[Record] = []
    for probe in all_probes():
        if only and only not in probe.id:
            continue
        # configs cost nothing: more draws there; a trace costs most: fewer
        traced = "trace" in probe.id or "swap" in probe.id or "collect" in probe.id
        n = examples * 4 if probe.group == "config" else max(3, examples // 2) if traced else examples

        _run_probe(probe, n, derandomize, records)
    return records


def table(records: list[Record]) -> str:
    counts = Counter(r.outcome for r in records)
    lines = [f"{len(records)} generated calls over {len({r.probe for r in records})} probes: "
             + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES)]
    for probe in dict.fromkeys(r.probe for r in records):
        c = Counter(r.outcome for r in records if r.probe == probe)
        lines.append(f"  {probe}: " + ", ".join(f"{c[o]} {o}" for o in OUTCOMES if c[o]))
    bad = [r for r in records if r.outcome not in PASS]
    if bad:
        lines.append("failing examples:")
        seen: set[tuple[str, str]] = set()
        for r in bad:
            key = (r.probe, r.detail[:60])
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"  [{r.outcome}] {r.probe} {r.args}: {r.detail}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=25)
    ap.add_argument("--explore", action="store_true", help="random draws instead of the derandomized ones")
    ap.add_argument("--only", default=None, help="run the probes whose id contains this")
    ap.add_argument("--json", default=None, help="write every record to this file")
    ns = ap.parse_args(argv)
    records = run_all(ns.examples, not ns.explore, ns.only)
    if ns.json:
        Path(ns.json).write_text(json.dumps([r.__dict__ for r in records], indent=1))
    print(table(records))
    return 0 if all(r.outcome in PASS for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
