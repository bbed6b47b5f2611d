"""Peak host memory of the load / save / fold / checkpoint paths the first host-memory probe did not measure
(issue 21 goal 3; docs/reliability.md, "Host memory probe, round 2").

Each path runs in a fresh interpreter, after a warm-up that pays the one-time costs (imports, torch's meta kernels,
a first save / load / training step on a small module); peak = ``VmHWM`` after ``clear_refs`` 5 minus ``VmRSS``
before the call, as a multiple of the module's bytes (``SIZE``: a 134 MB module: a Lorsa with 262,144 OV heads at
d_model 64, a TopK transcoder / SAE with 262,144 latents). ``read`` is the tensor bytes the safetensors readers
handed out during the call (``safetensors.torch.load_file`` and ``safe_open(...).get_tensor`` / slices, counted
by a wrapper), as a multiple of ``SIZE``.

    OMP_NUM_THREADS=1 python -m benchmarks.host_memory_paths [--cases NAME ...] [--name host_memory_paths]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

PRE = '''
import gc, json, os, ctypes, torch, safetensors, safetensors.torch
torch.manual_seed(0)
READ = [0]
def _nb(t):
    return t.numel() * t.element_size()
_load_file = safetensors.torch.load_file
def _counted_load_file(*a, **k):
    out = _load_file(*a, **k)
    READ[0] += sum(_nb(t) for t in out.values())
    return out
safetensors.torch.load_file = _counted_load_file
_safe_open = safetensors.safe_open
class _Slice:
    def __init__(self, s):
        self._s = s
    def __getitem__(self, i):
        t = self._s[i]
        READ[0] += _nb(t)
        return t
    def __getattr__(self, name):
        return getattr(self._s, name)
class _Open:
    def __init__(self, *a, **k):
        self._f = _safe_open(*a, **k)
    def __enter__(self):
        self._f.__enter__()
        return self
    def __exit__(self, *a):
        return self._f.__exit__(*a)
    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        READ[0] += _nb(t)
        return t
    def get_slice(self, name):
        return _Slice(self._f.get_slice(name))
    def __getattr__(self, name):
        return getattr(self._f, name)
safetensors.safe_open = _Open
def _st(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def nbytes(m):
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())
from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa import formats
from nnsight_lorsa.training import TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch
D = 64
def lorsa(n_ov=262144):                                 # 134 MB of W_V + W_O in fp32
    return Lorsa(LorsaConfig(d_model=D, n_qk_heads=64, d_qk_head=16, n_ov_heads=n_ov, top_k=64))
def tc(n=262144, act="topk", **kw):
    return Transcoder(TranscoderConfig(d_in=D, d_sae=n, activation=act,
                                       activation_params={"k": 64} if act == "topk" else {}, **kw))
def sae(n=262144):
    return SparseAutoencoder(SAEConfig(d_in=D, d_sae=n, activation="topk", activation_params={"k": 16}))
def clt(n=131072):                                     # 168 MB: W_enc 2 layers, W_dec 3 (layer, later) blocks
    return CrossLayerTranscoder(CLTConfig(d_in=D, d_sae=n, n_layers=2))
def source(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(2, 8, D, generator=g)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[:, 0] = False
    return Batch(x=x, y=x, loss_mask=mask)
def clt_source(i):                                     # the same tokens at both layers: (2, batch, pos, D)
    b = source(i)
    return Batch(x=torch.stack([b.x, b.x]), y=torch.stack([b.x, b.x]), loss_mask=b.loss_mask)
def norms_only(m, src=None):                           # scale factors estimated, no step (nothing else held)
    t = Trainer(m, src or source, TrainConfig(total_steps=4, lr=1e-3, norm_batches=1))
    t.estimate_norms()
    return t
def trainer(m, steps=1):
    t = Trainer(m, source, TrainConfig(total_steps=4, lr=1e-3, norm_batches=1))
    for _ in range(steps):
        t.train_step()
    return t
tmp = os.environ["HOST_MEMORY_TMP"]                  # the parent's scratch folder, removed by it
LS = dict(hook_point_in="blocks.0.ln1.hook_normalized", hook_point_out="blocks.0.hook_attn_out")
CT = dict(feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
w = Lorsa(LorsaConfig(d_model=D, n_qk_heads=4, d_qk_head=16, n_ov_heads=64, top_k=4))  # one-time costs (imports,
formats.save(w, tmp + "/w"); formats.load(tmp + "/w"); formats.load(tmp + "/w", dtype=torch.bfloat16)  # meta kernels)
formats.load(tmp + "/w", device="meta")
w.to(torch.bfloat16); w.normalize_decoder_()
_wt = trainer(sae(256), 2); _wt.folded(); _wt.save_checkpoint(tmp + "/wc"); Trainer.resume(tmp + "/wc", source)
del _wt
'''


def _saved(make: str, fmt: str, where: str, **kw: str) -> str:
    extra = "".join(f", {k}={v!r}" for k, v in kw.items())
    return f"m = {make}; SIZE = nbytes(m); formats.save(m, tmp + {where!r}, format={fmt!r}{extra}); del m"


_CT2 = ("m = {0: tc(131072, 'relu', layer=0), 1: tc(131072, 'relu', layer=1)}; SIZE = sum(map(nbytes, m.values()));"
        " formats.save(m, tmp + '/c', format='circuit_tracer', **CT); del m")
_SET = ("m = {i: lorsa(131072) for i in (0, 1)}; SIZE = sum(map(nbytes, m.values()))\n"
        "for i, x in m.items(): formats.save(x, tmp + f'/set/layer_{i}')\n"
        "del m, x")
_TSET = ("m = {i: tc(131072, layer=i) for i in (0, 1, 2, 3)}; SIZE = sum(map(nbytes, m.values()))\n"
         "for i, x in m.items(): formats.save(x, tmp + f'/tset/layer_{i}')\n"
         "del m, x")
_TRAIN = "t = trainer(sae()); SIZE = nbytes(t.module)"
_TRAIN_BF16 = "t = trainer(sae().to(torch.bfloat16)); SIZE = nbytes(t.module)"
_FOLD_BF16 = "t = norms_only({}.to(torch.bfloat16){}); SIZE = nbytes(t.module)"
_CKPT = _TRAIN + "; t.save_checkpoint(tmp + '/ck'); del t; gc.collect()"
_CKPT_BF16 = _TRAIN_BF16 + "; t.save_checkpoint(tmp + '/ck'); del t; gc.collect()"

#: (name, setup (sets SIZE), operation, what is necessary, in module sizes)
CASES: list[tuple[str, str, str, float]] = [
    ("lorsa load (ours) device=meta", _saved("lorsa()", "nnsight_lorsa", "/l"),
     "m = formats.load(tmp + '/l', device='meta')", 0.0),
    ("transcoder load (ours) device=meta", _saved("tc()", "nnsight_lorsa", "/t"),
     "m = formats.load(tmp + '/t', device='meta')", 0.0),
    ("transcoder load (saelens) device=meta",
     _saved("tc(act='relu')", "saelens", "/t", hook_name="blocks.0.ln2.hook_normalized"),
     "m = formats.load(tmp + '/t', device='meta')", 0.0),
    ("transcoder load (sparsify) device=meta", _saved("tc()", "sparsify", "/t"),
     "m = formats.load(tmp + '/t', d_model=D, device='meta')", 0.0),
    ("lorsa load (llamascopium) device=meta", _saved("lorsa()", "llamascopium", "/l", **{
        "hook_point_in": "blocks.0.ln1.hook_normalized", "hook_point_out": "blocks.0.hook_attn_out"}),
     "m = formats.load(tmp + '/l', device='meta')", 0.0),
    ("transcoders load (circuit_tracer, 2 layers) device=meta", _CT2,
     "m = formats.load(tmp + '/c', format='circuit_tracer', device='meta')", 0.0),
    ("load_all, 2 Lorsa layers (ours)", _SET, "m = formats.load_all(tmp + '/set')", 1.0),
    ("load_all, 4 transcoder layers (ours)", _TSET, "m = formats.load_all(tmp + '/tset')", 1.0),
    ("load_all, 4 transcoder layers, dtype=bf16", _TSET,
     "m = formats.load_all(tmp + '/tset', dtype=torch.bfloat16)", 0.5),
    ("CLT save (ours)", "m = clt(); SIZE = nbytes(m)", "formats.save(m, tmp + '/x')", 0.0),
    ("CLT load (ours)", _saved("clt()", "nnsight_lorsa", "/x"), "m = formats.load(tmp + '/x')", 1.0),
    ("CLT save (circuit_tracer)", "m = clt(); SIZE = nbytes(m)",
     "formats.save(m, tmp + '/x', format='circuit_tracer', **CT)", 0.0),
    ("CLT load (circuit_tracer)", _saved("clt()", "circuit_tracer", "/x", **{
        "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out"}),
     "m = formats.load(tmp + '/x', format='circuit_tracer')", 1.0),
    ("CLT load (circuit_tracer) device=meta", _saved("clt()", "circuit_tracer", "/x", **{
        "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out"}),
     "m = formats.load(tmp + '/x', format='circuit_tracer', device='meta')", 0.0),
    ("SAE convert sparsify -> saelens", _saved("sae()", "sparsify", "/s"),
     "formats.save(formats.load(tmp + '/s', d_model=D), tmp + '/s2', format='saelens', "
     "hook_name='blocks.0.hook_resid_post')", 1.0),
    ("Trainer.folded (SAE, fp32)", _TRAIN, "f = t.folded()", 1.0),
    ("Trainer.folded (SAE, bf16 + fp32 masters)", _TRAIN_BF16, "f = t.folded()", 1.0),
    ("Trainer.folded (Lorsa, bf16 + fp32 masters)", _FOLD_BF16.format("lorsa()", ""), "f = t.folded()", 1.0),
    ("Trainer.folded (TopK transcoder, bf16 + fp32 masters)", _FOLD_BF16.format("tc()", ""), "f = t.folded()", 1.0),
    ("Trainer.folded (CLT, bf16 + fp32 masters)", _FOLD_BF16.format("clt()", ", clt_source"), "f = t.folded()",
     1.0),
    ("Trainer.save_checkpoint (SAE, fp32)", _TRAIN, "t.save_checkpoint(tmp + '/ck')", 0.0),
    ("Trainer.save_checkpoint (SAE, bf16 + fp32 masters)", _TRAIN_BF16, "t.save_checkpoint(tmp + '/ck')", 0.0),
    ("Trainer.resume (SAE, fp32)", _CKPT, "t = Trainer.resume(tmp + '/ck', source)", 3.0),
    ("Trainer.resume (SAE, bf16 + fp32 masters)", _CKPT_BF16, "t = Trainer.resume(tmp + '/ck', source)", 7.0),
]


def run_fresh(code: str, timeout: float = 600) -> dict[str, Any]:
    """Runs ``code`` in a fresh interpreter (the repository on its path, one OpenMP thread, offline) and returns
    the JSON object its last line of output prints. Its scratch folder (``tmp`` in the code: the environment's
    ``HOST_MEMORY_TMP``) is a ``TemporaryDirectory`` of this process, removed even when the child fails or is
    killed by the timeout. Raises ``RuntimeError`` with the end of the child's stderr when it fails."""
    with tempfile.TemporaryDirectory(prefix="host_memory_") as tmp:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                   "PATH": "/usr/bin:/bin", "HOST_MEMORY_TMP": tmp}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def measure(setup: str, operation: str, timeout: float = 600) -> dict[str, float]:
    """``{"peak": x, "read": y}``: the peak resident memory of ``operation`` above the resident memory after
    ``setup`` and the tensor bytes read from safetensors files during it, each in module sizes (``SIZE``,
    set by ``setup``), in a fresh interpreter (``VmHWM`` reset by ``clear_refs`` 5)."""
    code = PRE + textwrap.dedent(setup) + '''
gc.collect(); ctypes.CDLL(None).malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")
base = _st("VmRSS"); READ[0] = 0
''' + textwrap.dedent(operation) + '''
print(json.dumps({"peak": _st("VmHWM") - base, "read": READ[0], "size": SIZE}))
'''
    out = run_fresh(code, timeout)
    return {"peak": out["peak"] / out["size"], "read": out["read"] / out["size"], "size_bytes": out["size"]}


def main() -> None:
    from benchmarks._timing import arg, command, parser, write

    args = parser(__doc__, cases=arg(nargs="*", type=str, default=[]),
                  label=arg("after", "key of this run's numbers in the JSON (before / after a fix)"),
                  name=arg("host_memory_paths", "results/<name>.json")).parse_args()
    path = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    old: dict[str, Any] = json.loads(path.read_text()).get("results", {}) if path.is_file() else {}
    for name, setup, operation, necessary in CASES:
        if args.cases and not any(c in name for c in args.cases):
            continue
        row = measure(setup, operation)
        old.setdefault(name, {})["necessary"] = necessary
        old[name][args.label] = {k: round(v, 3) if k != "size_bytes" else v for k, v in row.items()}
        print(f"{name:60s} peak {row['peak']:.2f}x  read {row['read']:.2f}x", flush=True)
    write(args.name, {"command": command(), "results": old})


if __name__ == "__main__":
    main()
