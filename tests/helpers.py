"""Shared test helpers: tiny random models of every supported family with a local tokenizer, factories for
Lorsas, SAEs, transcoders and CLTs, plain-PyTorch-hook references, and headless Chromium for rendered pages.

Nothing is downloaded: configs are built in code, weights are random (biases and norm gains randomised too, so
that a mistake in their handling cannot hide behind zeros and ones). No test module imports another: what
several tests share lives here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:  # nnsight_lorsa is imported inside the factories: the loopback server imports this
    from nnsight_lorsa import Lorsa  # module for the tiny models and must not load nnsight_lorsa
    from nnsight_lorsa.attribution.graph import Graph
    from nnsight_lorsa.modules import CrossLayerTranscoder, SparseAutoencoder, Transcoder

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def run_ranks(script: str, world: int, tmp_path: Path, extra: tuple[str, ...] = (), timeout: float = 120) -> None:
    """Runs ``python script rank world init out_prefix *extra`` in ``world`` processes (a gloo group's ranks: the
    worker reads them from its argv; ``out_prefix`` is ``tmp_path / f"rank{r}"``), with this tree and the tests on
    the path and one thread each.

    Fails (AssertionError with every rank's output) when a rank fails or ``timeout`` seconds pass; no rank outlives
    the call: once one rank has failed, the others (which would wait in a collective until gloo's 30-minute timeout)
    are killed, as are all ranks on a timeout or any error here. Logs go to files, not pipes: a full pipe cannot
    block a rank."""
    import time

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    init, out = str(tmp_path / "init"), str(tmp_path / "rank")
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs: list[subprocess.Popen] = []
    try:
        for r, log in enumerate(logs):
            with open(log, "wb") as f:
                procs.append(subprocess.Popen([sys.executable, script, str(r), str(world), init, f"{out}{r}", *extra],
                                              env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
               and all(p.returncode in (None, 0) for p in procs)):
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), [log.read_text(errors="replace") for log in logs]

VOCAB = 128
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 3

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
_COMMON = {"hidden_size": D_MODEL, "num_attention_heads": N_HEADS, "num_hidden_layers": N_LAYERS,
           "vocab_size": VOCAB, "intermediate_size": 128, "max_position_embeddings": 128}

FAMILIES = ("llama", "qwen2", "qwen3", "neox", "gpt2", "gemma2", "gemma3", "olmo2", "phi3", "gemma")
#: the families transformers runs with ``attn_implementation="sdpa"`` (it refuses Gemma-2: SDPA cannot soft-cap)
SDPA_FAMILIES = tuple(f for f in FAMILIES if f != "gemma2")


def meta_placement(module, name=None):  # type: ignore[no-untyped-def]
    """A stand-in for ``nnsight_lorsa._placement.placement`` that accepts modules held on ``meta`` (the real one
    refuses them: their weights were never loaded): ``(device, dtype)`` of the first floating parameter."""
    t = module if isinstance(module, torch.Tensor) else next(p for p in module.parameters() if p.is_floating_point())
    return t.device, t.dtype


def load_script(path: Path, name: str):
    """A script outside the package (``benchmarks/…``, ``scripts/…``) imported from its path as module
    ``name`` (registered in ``sys.modules``; its folder on ``sys.path`` for its sibling imports)."""
    import importlib.util
    import sys

    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def rope_kwargs(params: dict) -> dict:
    """RoPE settings as the installed transformers reads them: ``rope_parameters`` (5) or
    ``rope_theta`` + ``rope_scaling`` (4)."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": dict(params)}
    return {"rope_theta": params["rope_theta"], "rope_scaling": {k: v for k, v in params.items() if k != "rope_theta"}}


def tiny_config(family: str) -> transformers.PretrainedConfig:
    if family == "llama":  # GQA + llama3 rope scaling, like Llama-3.1-8B
        return transformers.LlamaConfig(**_COMMON, num_key_value_heads=2, **rope_kwargs(LLAMA3_ROPE))
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON, num_key_value_heads=2)
    if family == "mistral":  # sliding window on every layer, shorter than the test prompts (not in FAMILIES)
        return transformers.MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=4)
    if family == "qwen3":
        return transformers.Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=16)
    if family == "neox":
        return transformers.GPTNeoXConfig(**_COMMON, rotary_pct=0.25, rotary_emb_base=10000)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=D_MODEL, n_head=N_HEADS, n_layer=N_LAYERS, vocab_size=VOCAB,
                                       n_positions=128)
    if family == "gemma2":  # layers 0 and 2 sliding (window 4, shorter than the test prompts), caps that bite;
        # the padding row (zeros: its residual stream all zero, every norm at 1/sqrt(eps)) is the tokenizer's pad,
        # not the <bos> = 0 the prompts start with; weights at std 0.1 (at 0.02 the attention / MLP outputs are
        # ~100x below the residual and the post-norms scale them up 100-400x: fp32 edge sums lose two digits)
        return transformers.Gemma2Config(**_COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=1.5, final_logit_softcapping=3.0, sliding_window=4,
                                         pad_token_id=1, bos_token_id=0, eos_token_id=1, initializer_range=0.1)
    if family == "gemma3":  # Gemma-3 text: QK-norm, RoPE per layer type (local 10k on sliding layers 0 and 2)
        return transformers.Gemma3TextConfig(
            **_COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}},
            pad_token_id=1, bos_token_id=0, eos_token_id=1, initializer_range=0.1)
    if family == "olmo2":  # QK-norm over the whole projection, post-norms only (no pre-norms); weights at std 0.1
        # as Gemma-2's (at 0.02 the post-norms scale the sublayer outputs up ~100x: fp32 edge sums to 1e-3, fp64 1e-12)
        return transformers.Olmo2Config(**_COMMON, num_key_value_heads=2, pad_token_id=1, bos_token_id=0,
                                        eos_token_id=1, initializer_range=0.1)
    if family == "phi3":  # fused qkv_proj / gate_up_proj, partial rotary 0.5, window 4 on every layer
        return transformers.Phi3Config(**_COMMON, num_key_value_heads=2, sliding_window=4, pad_token_id=1,
                                       bos_token_id=0, eos_token_id=1, rope_parameters={
                                           "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})
    if family == "gemma":  # Gemma-1: 1 + weight RMSNorms, sqrt(d)-scaled embeddings, MQA; weights at std 0.1
        return transformers.GemmaConfig(**_COMMON, num_key_value_heads=1, head_dim=16, pad_token_id=1, bos_token_id=0,
                                        eos_token_id=1, initializer_range=0.1)
    raise KeyError(family)


def tiny_hf_model(family: str, seed: int = 0, attn: str = "eager") -> torch.nn.Module:
    return drawn_hf_model(tiny_config(family), seed, attn)


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ``<bos>``=0, ``<eos>``=1 (also pad), then ``w2 … w{vocab-1}``."""
    words = {"<bos>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<eos>", padding_side="left")


#: the devices a device-parametrised test runs on: the CPU always, CUDA as a ``gpu``-marked case
#: skipped where torch sees no CUDA device (``pytest.mark.parametrize("device", DEVICES)``).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


_TINY_LLAMA: list = []


def tiny_llama_shared():
    """``[model, hf, adapter]`` of one tiny Llama (``tiny_nnsight("llama")``) built once per process and shared by
    the tests that only read it (sets saved and loaded against it)."""
    if not _TINY_LLAMA:
        from nnsight_lorsa import get_adapter

        model, hf = tiny_nnsight("llama")
        _TINY_LLAMA.extend([model, hf, get_adapter(model)])
    return _TINY_LLAMA


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules hold the same state (the same names, every tensor equal bit for bit)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def tiny_nnsight(family: str, seed: int = 0, attn: str = "eager", device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
    """(nnsight TransformersModel, underlying HF model) for a tiny random model on ``device`` in ``dtype``
    (its weights drawn in fp32 on the CPU, then moved and cast: the same model on every device)."""
    from nnsight import TransformersModel

    hf = tiny_hf_model(family, seed, attn).to(device=device, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # device=: transformers' pipeline (which nnsight builds around a ready module) otherwise moves a CPU
        # module to cuda:0 whenever CUDA is available
        model = TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer(), device=device)
    return model, hf


def unembed(model):
    """The envoy of the model's unembedding (``lm_head``, or GPT-NeoX's ``embed_out`` on older transformers)."""
    from nnsight_lorsa import get_adapter

    return model.get(get_adapter(model).lm_head_path)


@torch.no_grad()
def head_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """The plain Hugging Face model's unembedding output on ``ids``: its logits before any final soft-capping
    (Gemma-2's ``final_logit_softcapping`` runs after ``lm_head``) — what ``unembed(model).output`` reads."""
    seen = []
    handle = hf.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        hf(ids)
    finally:
        handle.remove()
    return seen[0]


def random_ids(batch: int = 2, seq: int = 10, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    ids[:, 0] = 0
    return ids


def reconstruction_source(batch: int, seq: int, d: int):  # type: ignore[no-untyped-def]
    """A trainer's batch source of seeded random activations: batch ``i`` is ``randn(batch, seq, d)`` from seed ``i``
    as both ``x`` and ``y`` (an SAE's reconstruction), position 0 (BOS) not counted."""
    from nnsight_lorsa.training.activations import Batch

    def source(i: int) -> Batch:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(batch, seq, d, generator=g)
        mask = torch.ones(batch, seq, dtype=torch.bool)
        mask[:, 0] = False
        return Batch(x=x, y=x, loss_mask=mask)
    return source


def tiny_training_setup():
    """(nnsight model, HF model, adapter, TokenDataset of 48 random windows × 16) for training tests."""
    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.training import TokenDataset

    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model), TokenDataset(random_ids(batch=48, seq=16, seed=3))


FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=5000",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.skip("headless Chromium not installed (.ci/run installs Debian's chromium)")
    return path


def run_chromium(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    exe = require_chromium()
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [exe, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=timeout, check=True,
        )


def render_dom(html_file: Path, timeout: float = 60.0) -> str:
    """The page's DOM after its scripts ran (``chromium --dump-dom``)."""
    return run_chromium(["--dump-dom", Path(html_file).resolve().as_uri()], timeout).stdout


def screenshot(html_file: Path, png_file: Path, size: tuple[int, int] = (1200, 800), timeout: float = 60.0) -> Path:
    """Render ``html_file`` to ``png_file`` (returns it); fails if Chromium wrote nothing."""
    run_chromium([f"--screenshot={Path(png_file).resolve()}", f"--window-size={size[0]},{size[1]}",
          Path(html_file).resolve().as_uri()], timeout)
    if not Path(png_file).exists() or Path(png_file).stat().st_size == 0:
        raise AssertionError(f"Chromium wrote no screenshot for {html_file}")
    return Path(png_file)


#: appended to a page by :func:`first_paint`: after the page's own scripts ran, how many ``circle.node`` of
#: each ``data-kind`` lie on screen (inside the window and ``#main``, below its sticky ``#top`` header, at
#: least 3 px wide), written into ``<pre id="first-paint-probe">`` as JSON ``{kind: [visible, total]}``
_PROBE = """<script>
window.addEventListener('load', () => setTimeout(() => {
  const main = document.getElementById('main'), head = document.getElementById('top');
  const m = main ? main.getBoundingClientRect() : {left: 0, top: 0, right: innerWidth, bottom: innerHeight};
  const y0 = Math.max(0, m.top, head ? head.getBoundingClientRect().bottom : 0);
  const out = {};
  document.querySelectorAll('circle.node').forEach(c => {
    const r = c.getBoundingClientRect(), k = c.getAttribute('data-kind');
    const on = r.width >= 3 && r.left >= Math.max(0, m.left) && r.right <= Math.min(innerWidth, m.right)
      && r.top >= y0 && r.bottom <= Math.min(innerHeight, m.bottom);
    out[k] = out[k] || [0, 0]; out[k][1] += 1; if (on) out[k][0] += 1;
  });
  const svg = document.getElementById('graph');
  out['scale'] = svg ? +svg.getAttribute('data-scale') : null;
  const pre = document.createElement('pre'); pre.id = 'first-paint-probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 0));
</script>"""


def first_paint(html_file: Path, work_dir: Path, size: tuple[int, int] = (1400, 900), timeout: float = 60.0) -> dict:
    """``{kind: [visible, total], "scale": zoom}`` of a graph-viewer page at first paint in a ``size`` window
    (headless Chromium; the page is copied into ``work_dir`` with a probe script appended)."""
    import json
    import re

    page = Path(html_file).read_text(encoding="utf-8")
    assert page.count("</body>") == 1
    probed = Path(work_dir) / f"probed-{Path(html_file).name}"
    probed.write_text(page.replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    dom = run_chromium([f"--window-size={size[0]},{size[1]}", "--dump-dom", probed.resolve().as_uri()], timeout).stdout
    m = re.search(r'<pre id="first-paint-probe">(.*?)</pre>', dom, re.S)
    assert m, "the probe did not run: " + dom[-500:]
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


LAYER = 1


def make_lorsa(hf, adapter, layer: int = LAYER, seed: int = 0) -> Lorsa:
    from nnsight_lorsa import Lorsa, LorsaConfig

    w = adapter.mhsa_weights(hf, layer)
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=16 * w.n_heads, top_k=8, qk_heads_per_mhsa_head=2, layer=layer)
    lorsa = Lorsa(cfg)
    lorsa.init_from_mhsa(w, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        lorsa.b_D.normal_(0, 0.1)
    return lorsa


def attention_call_args(hf, adapter, layer: int, ids: torch.Tensor) -> tuple[tuple, dict]:
    """Run ``hf`` on ``ids`` ``(batch, pos)`` without grad; return the (args, kwargs) of layer ``layer``'s attention
    call (by a forward pre-hook, removed after)."""
    seen: dict = {}
    handle = adapter.attention_module(hf, layer).register_forward_pre_hook(
        lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        handle.remove()
    return seen["a"], seen["k"]


def hooked_logits_with_doubled_attention_input(hf, adapter, lorsas: dict[int, Lorsa], layer: int,
                                               ids: torch.Tensor) -> torch.Tensor:
    """Reference for an edit of a replaced attention's input: the plain model's logits (:func:`head_logits`) with
    the Lorsas spliced by plain PyTorch hooks (:func:`hooked`) and a forward pre-hook doubling layer ``layer``'s
    attention input (the adapter's ``attention_input``), which the Lorsa there then reads."""
    def double(module, args, kwargs):
        adapter.attention_input(args, kwargs).mul_(2)

    handle = adapter.attention_module(hf, layer).register_forward_pre_hook(double, with_kwargs=True)
    try:
        with hooked(hf, adapter, lorsas):
            return head_logits(hf, ids)
    finally:
        handle.remove()


@contextlib.contextmanager
def hooked(hf, adapter, lorsas: dict[int, Lorsa], edit=None, key_mask=None):
    """Reference: the same splice with plain PyTorch forward hooks (no nnsight). A Lorsa is global: on a
    sliding-window layer it gets ``key_mask`` (the batch's ``(batch, pos)`` padding mask; None: unpadded), not the
    layer's mask, which carries the MHSA's window (docs/nnsight.md, "Sliding-window layers")."""
    handles = []
    for layer, lorsa in lorsas.items():
        sliding = adapter.sliding_window(layer) is not None

        def hook(module, args, kwargs, output, lorsa=lorsa, sliding=sliding):
            x = adapter.attention_input(args, kwargs)
            z_pre = lorsa.compute_z_pre(x, adapter.attention_positions(args, kwargs, x),
                                        key_mask if sliding else adapter.attention_mask(args, kwargs))
            z, _ = lorsa.activation(z_pre)
            if edit is not None:
                z = edit(z)
            return adapter.with_attention_output(output, lorsa.decode(z))
        handles.append(adapter.attention_module(hf, layer).register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def module_state(hf):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in hf.modules())
    return hooks, sorted(n for n, _ in hf.named_modules()), sorted(hf.state_dict())


D = 64  # tiny models' d_model


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-zero biases / skip weights, thresholds in (0, 0.5): nothing hides behind zeros."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("threshold"):
            p.copy_(0.5 * torch.rand(p.shape, generator=g))
        else:
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module


def circuit_tracer_hooked(module: Any, feature_input_hook: str, feature_output_hook: str) -> Any:
    """``module`` (a transcoder / CLT) recording these hooks as a circuit-tracer file does
    (``cfg.extra["circuit_tracer"]``, what ``formats.hook_sites.mlp_site_io`` reads); returns ``module``."""
    module.cfg.extra["circuit_tracer"] = {"feature_input_hook": feature_input_hook,
                                          "feature_output_hook": feature_output_hook}
    return module


def make_transcoder(skip: bool = True, seed: int = 0, **cfg) -> Transcoder:
    from nnsight_lorsa.modules import SkipTranscoder, Transcoder, TranscoderConfig

    torch.manual_seed(seed)
    kw = {"d_in": D, "d_sae": 128, "activation": "topk", "activation_params": {"k": 8}, **cfg}
    return randomize_((SkipTranscoder if skip else Transcoder)(TranscoderConfig(**kw)), seed)


def coordinate_sae(d: int) -> SparseAutoencoder:
    """ReLU SAE with ``W_enc = [I, −I]``, ``W_dec = [I; −I]``: feature ``c`` is ``relu(x_c)`` along ``e_c``,
    feature ``d + c`` is ``relu(−x_c)`` along ``−e_c`` — ablating either zeroes coordinate ``c``."""
    from nnsight_lorsa.modules import SAEConfig, SparseAutoencoder

    sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=2 * d, activation="relu"))
    eye = torch.eye(d)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([eye, -eye], 1))
        sae.W_dec.copy_(torch.cat([eye, -eye], 0))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae


def make_sae(seed: int = 0, **cfg) -> SparseAutoencoder:
    from nnsight_lorsa.modules import SAEConfig, SparseAutoencoder

    torch.manual_seed(seed)
    kw = {"d_in": D, "d_sae": 128, "activation": "jumprelu", **cfg}
    return randomize_(SparseAutoencoder(SAEConfig(**kw)), seed)


def pattern_holding_attention(arch: Any, recording: Any, patterns: dict) -> Any:
    """A stand-in for ``arch.eager_attention_forward`` (``arch``: a transformers model module): while ``recording()``
    it runs the original and keeps each attention module's pattern in ``patterns`` (by ``id(module)``); otherwise it
    holds that pattern (a frozen attention: ``pattern @ value``, differentiable in the value only)."""
    original = arch.eager_attention_forward

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if recording():
            out, w = original(module, query, key, value, attention_mask, *args, **kwargs)
            patterns[id(module)] = w.detach()
            return out, w
        w = patterns[id(module)]
        v = arch.repeat_kv(value, module.num_key_value_groups) if hasattr(arch, "repeat_kv") else value
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    return attention


def pattern_held_logits(hf, monkeypatch, inputs: dict, hooks_of) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The unembedding's output of ``hf(**inputs)`` with every attention pattern held at the first (unedited) pass's
    (:func:`pattern_holding_attention`) and the forward hooks ``hooks_of(st)`` registered for both passes (acting when
    ``not st["record"]``): frozen attention's reference (``tests/patching/test_*frozen_attention*.py``)."""
    import importlib

    arch = importlib.import_module(type(hf).__module__)
    st: dict = {"record": True, "pattern": {}}
    monkeypatch.setattr(arch, "eager_attention_forward",
                        pattern_holding_attention(arch, lambda: st["record"], st["pattern"]))
    seen: list = []
    hooks = [*hooks_of(st), hf.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(o))]
    try:
        with torch.no_grad():
            hf(**inputs)
            st["record"] = False
            hf(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen[-1]


def drawn_clt(n_layers: int, d_sae: int, kind: str, skip: bool, seed: int, d_model: int = 64) -> Any:
    """A CrossLayerTranscoder with drawn weights away from its initialisation: JumpReLU thresholds in
    ``[0, 0.4)``, a small skip, every other weight perturbed; TopK's ``k`` is ``d_sae // 6`` (at least 1)."""
    from nnsight_lorsa.modules import CLTConfig, CrossLayerTranscoder

    params = {"k": max(1, d_sae // 6)} if kind == "topk" else {}
    clt = CrossLayerTranscoder(CLTConfig(d_in=d_model, d_sae=d_sae, n_layers=n_layers, activation=kind,
                                         activation_params=params, skip=skip))
    g = torch.Generator().manual_seed(seed)
    clt.reset_parameters(g)
    with torch.no_grad():
        for name, p in clt.named_parameters():
            if name.endswith("threshold"):
                p.copy_(0.4 * torch.rand(p.shape, generator=g))
            elif name == "W_skip":
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return clt


def make_clt(n_layers: int = 3, skip: bool = False, seed: int = 0) -> CrossLayerTranscoder:
    from nnsight_lorsa.modules import CLTConfig, CrossLayerTranscoder

    torch.manual_seed(seed)
    cfg = CLTConfig(d_in=D, d_sae=48, n_layers=n_layers, activation="jumprelu", skip=skip)
    return randomize_(CrossLayerTranscoder(cfg), seed)


def make_transcoders(layers, d_model=64, seed=0, skip_layer=None):
    from nnsight_lorsa.modules import SkipTranscoder, Transcoder, TranscoderConfig

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        cls = SkipTranscoder if layer == skip_layer else Transcoder
        act = ("jumprelu", {"threshold": 0.05}) if layer == skip_layer else ("topk", {"k": 6})
        tc = cls(TranscoderConfig(d_in=d_model, d_sae=192, activation=act[0], activation_params=act[1], layer=layer))
        with torch.no_grad():
            tc.b_dec.copy_(0.1 * torch.randn(d_model, generator=g))
            tc.b_enc.copy_(0.1 * torch.randn(192, generator=g))
            if isinstance(tc, SkipTranscoder):
                tc.W_skip.copy_(0.05 * torch.randn(d_model, d_model, generator=g))
        out[layer] = tc
    return out


def autograd_nodes(fn) -> set:
    """Every node of the autograd graph reachable from ``fn`` (a ``grad_fn``; None gives an empty set)."""
    seen, stack = set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return seen


def rm(model, lorsas=None, transcoders=None):
    """The replacement bundle every attribution entry point takes."""
    from nnsight_lorsa import ReplacementModel

    return ReplacementModel(model, lorsas=lorsas, transcoders=transcoders)


def attribution_setup(family):
    from nnsight_lorsa import get_adapter

    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    lorsas = {1: make_lorsa(hf, adapter, 1)}
    # layer 1 keeps no transcoder (its MLP becomes error nodes); layer 2 has a skip transcoder
    return model, hf, lorsas, make_transcoders((0, 2), skip_layer=2)


def attribution_replacement_on(device: str):
    """:func:`attribution_setup`'s tiny Llama with its Lorsa and transcoders moved to ``device``, as a replacement
    bundle (:func:`rm`)."""
    model, hf, lorsas, tcs = attribution_setup("llama")
    hf.to(device)
    for m in [*lorsas.values(), *tcs.values()]:
        m.to(device)
    return rm(model, lorsas, tcs)


def check_resume_bit_exact(make, source, ckpt: Path, check_resumed=None):
    """Train ``make()`` 6 steps straight, and 3 steps + checkpoint + :meth:`Trainer.resume` + 3 more:
    the two runs must end bit-equal (state dict, dead counters, last history entry). ``check_resumed(
    straight, first, resumed)`` runs right after the resume (before its steps). Returns the straight
    trainer. Small ``dead_after_tokens`` so AuxK is active too."""
    from nnsight_lorsa.training import TrainConfig, Trainer

    config = dict(total_steps=6, lr=1e-2, dead_after_tokens=50)
    straight = Trainer(make(), source, TrainConfig(**config))
    straight.train(progress=False)
    first = Trainer(make(), source, TrainConfig(**config))
    first.train(3, progress=False)
    first.save_checkpoint(ckpt)
    resumed = Trainer.resume(ckpt, source)
    if check_resumed is not None:
        check_resumed(straight, first, resumed)
    resumed.train(progress=False)
    for (name, a), b in zip(straight.module.state_dict().items(), resumed.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(straight.tokens_since_fired, resumed.tokens_since_fired)
    assert straight.history[-1] == resumed.history[-1]
    return straight


def recording_tqdm(monkeypatch, module) -> list[bool]:
    """Replace ``module.tqdm`` by the real one, recording whether each bar it opens is disabled."""
    real = module.tqdm
    disabled: list[bool] = []

    def record(*args, **kwargs):
        disabled.append(bool(kwargs.get("disable", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "tqdm", record)
    return disabled


def recorded_outcomes(script: str, out_dir: Path) -> list[dict]:
    """Run ``tests/<script>`` (the hostile table, the generated probe) in a fresh interpreter — without the
    suite's beartype hook, as a user's process runs — and return the records it writes with ``--json``."""
    tests = Path(__file__).resolve().parent
    out = out_dir / "records.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]),
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(tests / script), "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert out.is_file(), done.stderr[-3000:]
    return json.loads(out.read_text())


def assert_same_nodes(graph, other) -> None:
    """Two attribution graphs hold the same nodes (kind, layer, position and index of each, in order)."""
    for name in ("kind", "layer", "pos", "index"):
        assert torch.equal(getattr(graph.nodes, name), getattr(other.nodes, name)), name


def relative(a: Any, b: Any) -> float:
    """``max |a − b| / max |b|`` in float64 on the CPU (tensors or numbers; detached)."""
    x, y = (torch.as_tensor(t).detach().double().cpu() for t in (a, b))
    return float((x - y).abs().max() / y.abs().max().clamp_min(torch.finfo(torch.float64).tiny))


def relative_norm(a: Any, b: Any) -> float:
    """``‖a − b‖ / ‖b‖`` (Frobenius) in float64 on the CPU (tensors or numbers; detached)."""
    x, y = (torch.as_tensor(t).detach().double().cpu() for t in (a, b))
    return float((x - y).norm() / y.norm().clamp_min(torch.finfo(torch.float64).tiny))


def demeaned_logits(graph: "Graph", logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(graph's logit values, the same tokens' demeaned logits at the last position of logits)``, float64."""
    ids = graph.logit_ids
    last = logits.detach()[0, -1].double()
    return graph.values[ids].double(), last[graph.nodes.index[ids]] - last.mean()


#: one small ``activation_params`` per sparse-coder activation (the sync tests' coders: every kind)
ACTIVATION_PARAMS: dict[str, dict[str, float]] = {"relu": {}, "jumprelu": {"threshold": 0.05}, "topk": {"k": 4},
                                                  "batchtopk": {"k": 4}, "abstopk": {"k": 4}, "groupmax": {"k": 4}}

#: device-to-host reads as they reach the dispatcher (on ``meta`` most of them raise: recorded before running)
HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.masked_select",
              "aten._unique", "aten.unique", "aten.equal", "aten.allclose", "aten.bincount")


def sync_spy(host_reads_anywhere: bool = False):
    """A ``TorchDispatchMode`` recording, on a model held on ``meta``, each operator that copies from the host
    (reads a CPU tensor and writes a ``meta`` one: a ``non_blocking=False`` host-to-device copy on CUDA) in
    ``spy.copies``, and each one that reads a device value back on the host (:data:`HOST_READS`, or a ``meta``
    input with a CPU output) in ``spy.reads``; ``host_reads_anywhere``: the :data:`HOST_READS` made by nnsight_lorsa's
    code on CPU tensors too (a model on the CPU: transformers' ``generate`` reads values on ``meta``). Either
    makes the host wait for every kernel queued on CUDA."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def ours() -> str:  # the innermost frame of nnsight_lorsa's code, if any
        for frame in reversed(traceback.extract_stack()):
            if f"nnsight_lorsa{os.sep}" in frame.filename:
                return f"{frame.filename.rsplit('nnsight_lorsa' + os.sep, 1)[1]}:{frame.lineno}"
        return "(not ours)"

    def tensors(tree) -> list[torch.Tensor]:
        return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]

    class Spy(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies: list[str] = []
            self.reads: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ins = tensors((args, kwargs))
            on_meta = any(t.device.type == "meta" for t in ins)
            if str(func.overloadpacket).startswith(HOST_READS) and (on_meta or host_reads_anywhere):
                where = ours()
                if on_meta or where != "(not ours)":
                    self.reads.append(f"{func} at {where}")
            out = func(*args, **(kwargs or {}))
            outs = tensors(out)
            if any(t.device.type == "cpu" for t in ins) and any(t.device.type == "meta" for t in outs):
                self.copies.append(f"{func} from {[tuple(t.shape) for t in ins if t.device.type == 'cpu']} "
                                   f"at {ours()}")
            if on_meta and any(t.device.type == "cpu" for t in outs):
                self.reads.append(f"{func} to the host at {ours()}")
            return out

    return Spy()


def dense_budget_assembly(layout, scheduler, entries_of=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(adjacency, residual)`` of a budgeted graph as the former per-entry masks built it (the tests' reference): a
    dense ``(n, n)`` matrix filled from the stored sparse rows, edges from unvisited features summed into the residual.
    ``entries_of(rows)``: the stored ``(row, col, val)`` entries of the scheduler's ``SparseRows`` (default its own
    ``chunks()``; a test of ``chunks`` passes a reader of its own)."""
    targets = torch.tensor(scheduler.done)
    nf, ns, nl = layout.n_features, layout.n_sources, layout.n_logits
    visited = torch.zeros(nf, dtype=torch.bool)
    visited[targets[targets < nf]] = True
    keep_src = torch.cat([visited, torch.ones(ns - nf, dtype=torch.bool)])
    node_ids = torch.cat([keep_src.nonzero().flatten(), torch.arange(ns, ns + nl)])
    index = torch.full((ns + nl,), -1, dtype=torch.long)
    index[node_ids] = torch.arange(node_ids.numel())
    n = node_ids.numel()
    row_at = index[scheduler.position(scheduler.done)]
    sp = scheduler.sparse()
    adjacency = torch.zeros(n, n, dtype=sp.blocks[0].val.dtype)
    residual = torch.zeros(n, dtype=torch.float64)
    for row, col, val in (sp.chunks() if entries_of is None else entries_of(sp)):
        k = keep_src[col]
        adjacency[row_at[row[k]], index[col[k]]] = val[k]
        residual.index_add_(0, row_at[row[~k]], val[~k].double())
    return adjacency, residual.to(adjacency.dtype)


#: hypothesis settings of the generated probes: no deadline (a tiny model's first forward compiles), large draws
PROBE_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.filter_too_much])


def generated(examples: int, sweep: int, **strategies):
    """A hypothesis test with ``examples`` cases by default, and its sweep ``test_sweep_<name>`` (``slow``) with
    ``sweep`` cases, registered in the test's own module (``fn.__globals__``)."""
    def wrap(fn):
        name = fn.__name__.replace("test_", "test_sweep_", 1)
        fn.__globals__[name] = pytest.mark.slow(settings(max_examples=sweep, **PROBE_SETTINGS)(given(**strategies)(fn)))
        return settings(max_examples=examples, **PROBE_SETTINGS)(given(**strategies)(fn))
    return wrap


# ---- drawn model configurations (the random-configs probe; any other test may draw models from here) -------------

#: every adapter family (Mistral rides Llama's adapter) by its short name here
DRAWN_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "neox", "gpt2", "gemma", "gemma2", "gemma3", "olmo2", "phi3")
_TOKENS = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 1}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def drawn_configs(families: tuple[str, ...] = DRAWN_FAMILIES):  # type: ignore[no-untyped-def]
    """A hypothesis strategy of ``(family, transformers config)``: a tiny random model of ``families`` with drawn
    shapes — ``d_model`` 24–96 odd or even (GPT-2 / GPT-NeoX: ``n_heads · head_dim``, their head size fixed by it),
    1–8 heads, KV heads among the divisors (MHA, GQA, MQA), a ``head_dim`` of its own where the family reads
    ``config.head_dim``, 1–4 layers, intermediate sizes, ``rope_theta``, biases, tied embeddings, partial rotary
    (GPT-NeoX, Phi-3: odd rotary sizes too, which :func:`partial_rotary_refused` says the adapter refuses; a
    ``partial_rotary_factor`` the other families' attention ignores), GPT-NeoX's parallel residual, GPT-2's scale
    options (inverse-layer, none) and reordered upcast, sliding windows of 2–24 tokens (Mistral, Phi-3 every layer;
    Qwen2/3 ``max_window_layers``; Gemma-2/3 ``layer_types`` drawn), Gemma-2 soft-caps
    and ``query_pre_attn_scalar``. Configs transformers refuses are filtered out (``assume``)."""
    from huggingface_hub.errors import StrictDataclassClassValidationError
    from hypothesis import assume
    from hypothesis import strategies as st

    @st.composite
    def draw_config(draw):  # type: ignore[no-untyped-def]
        family = draw(st.sampled_from(families))
        n_layers = draw(st.integers(1, 4))
        n_heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        n_kv = draw(st.sampled_from(_divisors(n_heads)))
        theta = draw(st.sampled_from([10000.0, 500000.0, 160.0, 1e6]))
        inter = draw(st.integers(8, 96))
        tie = draw(st.booleans())
        window = draw(st.sampled_from([2, 3, 5, 8, 24]))
        common = {"num_hidden_layers": n_layers, "vocab_size": VOCAB, "tie_word_embeddings": tie}
        if family in ("gpt2", "neox"):
            head_dim = draw(st.sampled_from([4, 6, 8, 10, 12, 16]))
            d = n_heads * head_dim
        else:
            # transformers validates hidden_size % num_attention_heads (also with a head_dim of its own)
            d = n_heads * draw(st.integers(max(1, -(-24 // n_heads)), 96 // n_heads))
            head_dim = draw(st.sampled_from([4, 6, 8, 12, 16, 24, 32]))  # 32: above a d_model of 24–31 too
            if d % n_heads == 0 and (d // n_heads) % 2 == 0 and draw(st.booleans()):
                head_dim = d // n_heads  # the implicit head size
        own_head_dim = {"head_dim": head_dim}
        llama = {"hidden_size": d, "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
                 "intermediate_size": inter, "max_position_embeddings": 64, **common}
        rope = {"rope_type": "default", "rope_theta": theta}
        if family not in ("gpt2", "neox", "phi3", "gemma3") and draw(st.booleans()):
            rope["partial_rotary_factor"] = 0.5  # read by transformers' config, ignored by these families' attention
        try:
            if family == "gpt2":
                cfg = transformers.GPT2Config(
                    n_embd=d, n_head=n_heads, n_layer=n_layers, vocab_size=VOCAB, n_positions=64,
                    n_inner=draw(st.sampled_from([None, inter])), tie_word_embeddings=tie,
                    scale_attn_by_inverse_layer_idx=draw(st.booleans()), scale_attn_weights=draw(st.booleans()),
                    reorder_and_upcast_attn=draw(st.booleans()))
            elif family == "neox":  # an odd int(head_dim * pct) is drawn too: the adapter must refuse it, named
                pct = draw(st.sampled_from([0.25, 0.5, 1.0]))
                cfg = transformers.GPTNeoXConfig(
                    hidden_size=d, num_attention_heads=n_heads, intermediate_size=inter, max_position_embeddings=64,
                    rope_parameters={**rope, "partial_rotary_factor": pct}, attention_bias=draw(st.booleans()),
                    use_parallel_residual=draw(st.booleans()), **common)
            elif family == "phi3":
                pct = draw(st.sampled_from([0.5, 0.75, 1.0]))
                cfg = transformers.Phi3Config(**llama, **own_head_dim, sliding_window=draw(st.sampled_from([None,
                                              window])), rope_parameters={**rope, "partial_rotary_factor": pct},
                                              **_TOKENS)
            elif family in ("llama", "mistral", "olmo2", "gemma"):
                cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                       "olmo2": transformers.Olmo2Config, "gemma": transformers.GemmaConfig}[family]
                extra: dict = {"attention_bias": draw(st.booleans())}
                if family == "llama":
                    extra["mlp_bias"] = draw(st.booleans())
                if family == "mistral":
                    extra = {"sliding_window": draw(st.sampled_from([None, window]))}
                cfg = cls(**llama, **own_head_dim, **extra, rope_parameters=rope, **_TOKENS)
            elif family in ("qwen2", "qwen3"):
                sliding = draw(st.booleans())
                extra = {"attention_bias": draw(st.booleans())} if family == "qwen3" else {}
                cls = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
                cfg = cls(**llama, **own_head_dim, **extra, rope_parameters=rope, use_sliding_window=sliding,
                          sliding_window=window if sliding else None,
                          max_window_layers=draw(st.integers(0, n_layers)))
            else:  # gemma2, gemma3
                types = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=n_layers,
                                      max_size=n_layers))
                extra = {"query_pre_attn_scalar": draw(st.sampled_from([head_dim, 24, 7])),
                         "attention_bias": draw(st.booleans()), "sliding_window": window, "layer_types": types,
                         "initializer_range": 0.1}
                if family == "gemma2":
                    cfg = transformers.Gemma2Config(
                        **llama, **own_head_dim, **extra, rope_parameters=rope, **_TOKENS,
                        attn_logit_softcapping=draw(st.sampled_from([None, 1.5, 50.0])),
                        final_logit_softcapping=draw(st.sampled_from([None, 3.0])))
                else:
                    local = draw(st.sampled_from([10000.0, 160.0]))
                    kind = draw(st.sampled_from(["default", "linear"]))
                    cfg = transformers.Gemma3TextConfig(
                        **llama, **own_head_dim, **extra, **_TOKENS, rope_parameters={
                            "sliding_attention": {"rope_type": "default", "rope_theta": local},
                            "full_attention": {"rope_type": kind, "rope_theta": theta,
                                               **({"factor": 8.0} if kind == "linear" else {})}})
        except (ValueError, TypeError, StrictDataclassClassValidationError) as e:  # transformers' own validation
            assume(False)
            raise AssertionError from e  # pragma: no cover - assume(False) raises
        return family, cfg

    return draw_config()


def partial_rotary_refused(cfg: transformers.PretrainedConfig) -> bool:
    """Whether a drawn GPT-NeoX / Phi-3 config rotates an odd or empty ``int(head_dim * partial_rotary_factor)``
    (refused by the adapters with ``UnsupportedArchitectureError``, naming ``partial_rotary_factor``)."""
    if cfg.model_type not in ("gpt_neox", "phi3"):
        return False
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if cfg.model_type == "gpt_neox":
        head_dim = cfg.hidden_size // cfg.num_attention_heads
    rotary = int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    return rotary <= 0 or rotary % 2 == 1


@torch.no_grad()
def drawn_hf_model(cfg: transformers.PretrainedConfig, seed: int = 0, attn: str = "eager") -> torch.nn.Module:
    """The model of a config (drawn, or :func:`tiny_config`'s) with random weights, its biases and norm gains perturbed
    (by 0.1 of a standard normal)."""
    torch.manual_seed(seed)
    cfg._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name or "ln" in name.split(".")[-2:][0]:
            p.add_(0.1 * torch.randn_like(p))
    return model


def nnsight_of(hf: torch.nn.Module, device: str | torch.device = "cpu"):  # type: ignore[no-untyped-def]
    """The nnsight ``TransformersModel`` around a ready Hugging Face model (as :func:`tiny_nnsight` wraps)."""
    from nnsight import TransformersModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer(), device=device)
