"""Llama-3.1-8B shape on one GPU: Lorsa forward vs floor, replace vs plain trace, training and attribution.

Random bf16 weights built directly on the device (nothing downloaded): Llama-3.1-8B's shapes (32 layers,
d_model 4096, GQA 32/8 heads of 128, llama3 RoPE, vocab 128256) and the Lorsa paper's Table 1 Lorsa
(32K QK heads in groups of 128 = 256 independent QK heads of 128, 32K OV heads, top-k 128), TopK
transcoders (32K features, k 64) on the MLPs (issue 21, goal 4). Measures:

(a) the Lorsa module's forward against its floor (Q/K/V projections + ONE SDPA call with the OV heads as
    value dimension + the output projection) — goal <= 1.25; and against ``eager_minimum``, the floor plus the
    RoPE on queries and keys and the top-k with its scatter that a Lorsa must also do, in plain eager torch
    (``vs_eager_minimum``: what the module adds beyond the kernels it needs);
(b) ``LorsaSet.replace(layer=15)`` inside ``model.trace`` against the plain trace — goal <= 1.10;
(c) Lorsa training throughput (tokens/s): the model forward that reads the activations + the Lorsa
    fwd+bwd+AdamW step, next to the bare step on fixed activations: an fp32 Lorsa, and with ``--dtype bfloat16``
    also a bf16 Lorsa trained through fp32 master weights (``c_training_bfloat16_masters``);
(d) attribution with the Lorsa on every layer and transcoders on every MLP at each ``--tokens``: peak
    device memory next to ``estimate_memory``'s prediction and its terms (and the host peak next to its host
    estimate), the peak inside each phase (``phase_peaks``) and, with ``--memory-snapshot``, the allocations live at
    the peak by ``nnsight_lorsa`` frame (``memory_snapshot``; benchmarks/_device_peaks.py), with
    ``--profile-kernels`` the top operators of one more call by device and by host time (``kernel_profile``),
    and time per batch of target rows next to the
    floor (forward of B prompt copies with the embeddings requiring grad + one backward from B targets to the
    embeddings only; ``former_floor_*``: the same with every weight's gradient too, the floor used before
    2026-11-27, which made ``per_row_vs_floor`` look smaller);
    ``--offload``: the Lorsas and transcoders offloaded (``ReplacementSet.offload``: weights pinned on the
    host, each module copied to the GPU only while it computes), each one moved to the host as soon as it
    is built — the full replacement model on an 80 GB card; the active rows the frozen pass reads of them stay
    on the GPU when they fit (each row's ``offload_rows``: ``Graph.meta``), with ``--cap-gb`` decided against
    the cap (``attribute``'s ``max_memory`` = the cap minus what is allocated just before it).

    python -m benchmarks.gpu_scale                        # the 8B shape on cuda (H100/H200)
    python -m benchmarks.gpu_scale --scale tiny --device cpu --dtype float32 --tokens 32   # smoke run
    python -m benchmarks.gpu_scale --scale small --device cpu --dtype float32 --skip a b c --tokens 128 256
                                                          # (d)'s overhead above the floor, on CPU
    python -m benchmarks.gpu_scale --skip a b c --offload --tokens 4096   # (d) offloaded, on an 80 GB H100

Writes ``results/gpu_scale_<scale>_<device name>.json`` with the device name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._device_peaks import PhasePeaks, snapshot_peak_summary
from benchmarks._timing import RESULTS, arg, parser, profile_table, start, time_interleaved, write_json
from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet, ReplacementModel, TranscoderSet, get_adapter
from nnsight_lorsa.modules.rotary import apply_rotary, rotary_cos_sin

#: the scales: the 8B shape of issue 21, a CPU shape where the model's own compute dominates the attribution
#: batch as on the GPU (``small``: the per-batch overhead of attribution measured on CPU), and a CPU smoke shape
#: that exercises every code path
SCALES: dict[str, dict[str, Any]] = {
    "8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv=8, d_mlp=14336, vocab=128256, n_qk=256, n_ov=32768,
               top_k=128, d_tc=32768, k_tc=64, layer=15, batch_fwd=1, train_batch=8, train_seq=2048),
    "small": dict(n_layers=4, d_model=512, n_heads=8, n_kv=2, d_mlp=1376, vocab=4096, n_qk=32, n_ov=2048,
                  top_k=32, d_tc=4096, k_tc=32, layer=1, batch_fwd=1, train_batch=2, train_seq=256),
    # the 8B's ratios at d_model 512 (benchmarks/attribution_flops.py): head dim 128, GQA 4:1, d_mlp 3.5 d, vocab
    # 31.3 d, n_qk·d_qk = n_ov = d_tc = 8 d, top_k = n_ov / 256, k_tc = d_tc / 512; few layers (per-layer costs repeat)
    "ratios512": dict(n_layers=4, d_model=512, n_heads=4, n_kv=1, d_mlp=1792, vocab=16032, n_qk=32, n_ov=4096,
                      top_k=16, d_tc=4096, k_tc=8, layer=2, batch_fwd=1, train_batch=2, train_seq=512),
    "tiny": dict(n_layers=2, d_model=64, n_heads=4, n_kv=2, d_mlp=128, vocab=256, n_qk=8, n_ov=256, top_k=8,
                 d_tc=256, k_tc=8, layer=1, batch_fwd=1, train_batch=2, train_seq=32),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def host_peak_reset() -> int | None:
    """Reset Linux's host peak (``VmHWM``) to the current RSS and return that RSS in bytes (None off Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS")
    except OSError:
        return None


def host_peak() -> int:
    """The host peak (``VmHWM``) in bytes since :func:`host_peak_reset`."""
    return _status_bytes("VmHWM")


def peak_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def build(s: dict[str, Any], device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """(nnsight model, HF model): a random Llama with the scale's shapes, built on ``device`` in ``dtype``."""
    from nnsight import TransformersModel
    from transformers import LlamaConfig, LlamaForCausalLM

    from nnsight_lorsa.envoy.tokens import ids_only_tokenizer

    cfg = LlamaConfig(hidden_size=s["d_model"], intermediate_size=s["d_mlp"], num_hidden_layers=s["n_layers"],
                      num_attention_heads=s["n_heads"], num_key_value_heads=s["n_kv"], vocab_size=s["vocab"],
                      max_position_embeddings=max(8192, s["train_seq"]), rms_norm_eps=1e-5,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      rope_theta=500000.0, tie_word_embeddings=False,
                      **({"head_dim": s["head_dim"]} if "head_dim" in s else {}))
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformersModel(hf, task="text-generation", tokenizer=ids_only_tokenizer(s["vocab"]),
                                 device=device), hf


def paper_lorsa(s: dict[str, Any], adapter: Any, hf: Any, layer: int, device: torch.device,
                dtype: torch.dtype) -> Lorsa:
    """The Lorsa of Table 1 for ``layer``, initialised from its MHSA (per MHSA head: no n_ov-sized gather)."""
    w = adapter.mhsa_weights(hf, layer)
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=s["n_ov"], top_k=s["top_k"],
                                qk_heads_per_mhsa_head=s["n_qk"] // w.n_heads, layer=layer)
    lorsa = Lorsa(cfg, device=device, dtype=dtype)
    lorsa.init_from_mhsa(w, generator=torch.Generator(device="cpu").manual_seed(layer))
    return lorsa


def forward_vs_floor(lorsa: Lorsa, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    """(a): the Lorsa forward against one SDPA call with the same shapes and the dense projections."""
    cfg, dev = lorsa.cfg, x.device
    b, n, d = x.shape
    h, e, g = cfg.n_qk_heads, cfg.d_qk_head, cfg.n_ov_heads // cfg.n_qk_heads
    Wq = lorsa.W_Q.detach().permute(1, 0, 2).reshape(d, h * e)
    Wk = lorsa.W_K.detach().permute(1, 0, 2).reshape(d, h * e)
    Wv, Wo = lorsa.W_V.detach().T.contiguous(), lorsa.W_O.detach()

    @torch.no_grad()
    def floor() -> None:
        q = (x @ Wq).view(b, n, h, e).transpose(1, 2)
        k = (x @ Wk).view(b, n, h, e).transpose(1, 2)
        v = (x @ Wv).view(b, n, h, g).transpose(1, 2)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)
        _ = z @ Wo
        sync(dev)

    rot = cfg.rotary
    cos, sin = rotary_cos_sin(rot, torch.arange(n, device=dev)) if rot is not None else (None, None)

    @torch.no_grad()
    def eager_minimum() -> None:  # the floor plus what a Lorsa must also do: RoPE on q and k, the top-k and scatter
        q = (x @ Wq).view(b, n, h, e).transpose(1, 2)
        k = (x @ Wk).view(b, n, h, e).transpose(1, 2)
        if rot is not None:
            q, k = apply_rotary(q, cos, sin, rot.interleaved), apply_rotary(k, cos, sin, rot.interleaved)
        v = (x @ Wv).view(b, n, h, g).transpose(1, 2)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / cfg.scale)
        z = z.transpose(1, 2).reshape(b, n, -1)
        vals, idx = z.topk(cfg.top_k, dim=-1, sorted=False)
        _ = torch.zeros_like(z).scatter_(-1, idx, vals.relu()) @ Wo
        sync(dev)

    @torch.no_grad()
    def ours() -> None:
        lorsa(x)
        sync(dev)

    z_pre = lorsa.compute_z_pre(x)
    z, _ = lorsa.activation(z_pre)

    def part(fn: Any) -> Any:
        @torch.no_grad()
        def run() -> None:
            fn()
            sync(dev)
        return run

    # where the time goes: the Lorsa's own stages, each alone (they sum to about its forward)
    stages = {"stage_qk_rope": part(lambda: lorsa.qk(x)), "stage_values": part(lambda: lorsa.values(x)),
              "stage_z_pre": part(lambda: lorsa.compute_z_pre(x)), "stage_topk": part(lambda: lorsa.activation(z_pre)),
              "stage_decode": part(lambda: lorsa.decode(z))}
    res = time_interleaved({"floor": floor, "eager_minimum": eager_minimum, "lorsa": ours, **stages}, repeats=repeats)
    # ratio: against the floor (the goal's); vs_eager_minimum: against the same math written as plain eager torch with
    # the RoPE and top-k a Lorsa must do (what the module adds beyond the kernels it needs)
    return {**res, "ratio": res["lorsa"]["median_s"] / res["floor"]["median_s"], "goal": 1.25,
            "vs_eager_minimum": res["lorsa"]["median_s"] / res["eager_minimum"]["median_s"]}


def replace_vs_trace(model: Any, lorsas: LorsaSet, ids: torch.Tensor, layer: int, repeats: int) -> dict[str, Any]:
    """(b): ``replace(layer)`` in a trace against the plain trace (same save)."""
    import nnsight

    dev = next(model._module.parameters()).device

    @torch.no_grad()
    def plain() -> None:
        with model.trace(ids):
            nnsight.save(model.lm_head.output)
        sync(dev)

    @torch.no_grad()
    def replaced() -> None:
        with model.trace(ids):
            lorsas.replace(layer=layer)
            nnsight.save(model.lm_head.output)
        sync(dev)

    x = torch.randn(*ids.shape, lorsas[layer].cfg.d_model, device=dev, dtype=lorsas[layer].W_O.dtype)

    @torch.no_grad()
    def lorsa_alone() -> None:  # the module on an input of the same shape, outside any trace
        lorsas[layer](x)
        sync(dev)

    attention = model.model.layers[layer].self_attn
    skipped_value = (torch.zeros(*ids.shape, lorsas[layer].cfg.d_model, device=dev,
                                 dtype=next(model._module.parameters()).dtype), None)

    @torch.no_grad()
    def replaced_mhsa_skipped() -> Any:
        # the same replacement with the MHSA's own forward skipped (nnsight's .skip() of the attention module: the
        # Lorsa, reading the attention's input, replaces the skip value; docs/nnsight.md) -- what error=False
        # would cost if the discarded MHSA output were not computed (a plain trace only: a generation's KV cache
        # needs the MHSA's keys and values)
        with model.trace(ids):
            lorsas.replace(layer=layer)
            attention.skip(skipped_value)
            out = nnsight.save(model.lm_head.output)
        sync(dev)
        return out

    with torch.no_grad(), model.trace(ids):
        lorsas.replace(layer=layer)
        expected = nnsight.save(model.lm_head.output)
    same = bool(torch.equal(replaced_mhsa_skipped(), expected))  # the MHSA's output is discarded: the same logits
    res = time_interleaved({"plain_trace": plain, "replace": replaced, "lorsa_alone": lorsa_alone,
                            "replace_mhsa_skipped": replaced_mhsa_skipped}, repeats=repeats)
    # what the splice adds beyond the plain trace and the module's own forward (nnsight's and ours)
    splice = res["replace"]["median_s"] - res["plain_trace"]["median_s"] - res["lorsa_alone"]["median_s"]
    return {**res, "ratio": res["replace"]["median_s"] / res["plain_trace"]["median_s"], "goal": 1.10,
            "splice_overhead_s": splice,
            "ratio_mhsa_skipped": res["replace_mhsa_skipped"]["median_s"] / res["plain_trace"]["median_s"],
            "mhsa_skipped_same_logits": same}


def training(model: Any, hf: Any, lorsa: Lorsa, s: dict[str, Any], steps: int) -> dict[str, Any]:
    """(c): tokens/s of a Lorsa step with the activations read from the model, and of the bare step."""
    from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer

    dev = lorsa.W_O.device
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, s["vocab"], ((steps + 2) * s["train_batch"], s["train_seq"]), generator=g)
    data = TokenDataset(ids)
    source = ActivationSource.attention(model, s["layer"], data, s["train_batch"], seed=0)
    trainer = Trainer(lorsa, source, TrainConfig(total_steps=steps + 1, lr=1e-4))
    trainer.train_step()  # warm-up (also the norm estimate and the first batch)
    sync(dev)
    peak_reset(dev)
    t = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync(dev)
    with_model = time.perf_counter() - t
    batch = source(0)
    t = time.perf_counter()
    for _ in range(steps):  # the bare step on fixed activations: loss, backward, optimizer (fp32 masters of bf16)
        loss, _ = trainer.loss(batch)
        loss.backward()
        trainer.masters.move_grads()
        trainer.optimizer.step()
        trainer.masters.round_()
        trainer.optimizer.zero_grad(set_to_none=True)
    sync(dev)
    bare = time.perf_counter() - t
    tokens = steps * s["train_batch"] * s["train_seq"]
    return {"tokens_per_s_with_model": tokens / with_model, "tokens_per_s_bare_step": tokens / bare,
            "peak_bytes": peak_bytes(dev), "steps": steps, "batch": [s["train_batch"], s["train_seq"]]}


def floor_pass(hf: Any, ids: torch.Tensor, b: int, weight_grads: bool = False) -> None:
    """One pass of the floor of an attribution batch (:func:`attribution_floor`): forward of ``b`` copies of ``ids``
    with the embeddings requiring grad (the last position's logits only), one backward from ``b`` targets to the
    embeddings (``weight_grads``: ``.backward()``, every weight's gradient too, then dropped: the former floor)."""
    dev = next(hf.parameters()).device
    emb = hf.get_input_embeddings()(ids.to(dev)).detach().expand(b, -1, -1).clone().requires_grad_(True)
    logits = hf(inputs_embeds=emb, logits_to_keep=1).logits[:, -1]
    objective = logits[torch.arange(b, device=dev), torch.arange(b, device=dev)].sum()
    if weight_grads:
        objective.backward()
        hf.zero_grad(set_to_none=True)
    else:
        # the input gradient only, as attribution's backward (``inputs=[M]``): ``.backward()`` also computes
        # every weight's gradient and leaves ``.grad`` on the device (the model's size again)
        torch.autograd.grad(objective, emb)
    sync(dev)


def attribution_floor(hf: Any, ids: torch.Tensor, batch: int, repeats: int,
                      weight_grads: bool = False) -> tuple[float | None, int]:
    """``(seconds, batch)`` of the floor of one attribution batch (:func:`floor_pass`): forward of ``batch`` prompt
    copies with the embeddings requiring grad (only the last position's logits, ``logits_to_keep=1``), one backward
    from ``batch`` targets to the embeddings only (``torch.autograd.grad``: no weight gradients, which attribution
    does not compute either; until 2026-11-27 the floor used ``.backward()``, which also computed them and left
    them on the device) (median). Where ``batch`` copies do not fit the device, the largest batch that
    does (halving; the time is then scaled to ``batch`` rows, as attribution would run them) — ``None``
    when not even one copy fits. (On an H200 with 34 GB resident, 4 × 4096 tokens did not fit.)
    ``weight_grads=True``: the former floor (``.backward()``, weight gradients included, then dropped), measured
    beside the floor so that the (d) ratios recorded before 2026-11-27 can be set against it."""
    dev = next(hf.parameters()).device
    b = batch
    while b >= 1:
        try:
            seconds = time_interleaved({"floor": functools.partial(floor_pass, hf, ids, b, weight_grads)},
                                       repeats=repeats, warmup=1)["floor"]["median_s"]
            return seconds * batch / b, b
        except torch.cuda.OutOfMemoryError:
            peak_reset(dev)
            b //= 2
    return None, 0


_T0 = time.perf_counter()


def progress(message: str) -> None:
    """One line, stamped with the seconds since the benchmark started, printed at once: what a run stopped by a
    time limit got through (gpu_session.sh keeps the log)."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", flush=True)


@contextlib.contextmanager
def reporting(times: dict[str, float], every: float = 15.0) -> Iterator[None]:
    """While inside, print ``times`` (the stages' seconds so far) every ``every`` seconds from a daemon thread."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every):
            progress("phases so far: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(times.items())))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


#: the stages of one ``attribute`` call timed by :func:`phase_times`: (module, attribute, name)
PHASES = [("engine", "prepare", "clean_pass_and_layout"), ("trace", "frozen_forward_body", "frozen_forward"),
          ("trace", "nnsight_backward", "backward"), ("rows", "RowStore.record", "record_rows"),
          ("rows", "RowScheduler.next_rows", "next_rows_influence"), ("engine", "assemble", "assemble"),
          ("engine", "assemble_pruned", "assemble")]


@contextlib.contextmanager
def phases_wrapped(wrap: Any) -> Iterator[None]:
    """While inside, each stage function of :data:`PHASES` is ``wrap(name, fn)`` (restored on exit): the one place
    the stages are patched (:func:`phase_totals`; ``offload_memory_terms``' profiler labels)."""
    import importlib

    undo = []
    for mod_name, path, name in PHASES:
        owner: Any = importlib.import_module(f"nnsight_lorsa.attribution.{mod_name}")
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)
        setattr(owner, attr, wrap(name, fn))
        undo.append((owner, attr, fn))
    try:
        yield
    finally:
        for owner, attr, fn in reversed(undo):
            setattr(owner, attr, fn)


@contextlib.contextmanager
def phase_totals(reading: Any, peaks: PhasePeaks | None = None) -> Iterator[tuple[dict[str, float],
                                                                            dict[str, list[float]]]]:
    """``(totals, calls)``: how much ``reading()`` (a clock, a FLOP counter's total) grew in each stage of the
    ``attribute`` calls inside (:data:`PHASES`), summed and per call (``backward`` without ``record_rows``, which runs
    inside it: in the totals). ``peaks``: told each stage's entry and exit
    (:class:`benchmarks._device_peaks.PhasePeaks`: the peak device memory reached inside each stage)."""
    totals: dict[str, float] = {}
    calls: dict[str, list[float]] = {}

    def measuring(name: str, fn: Any) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            if peaks is not None:
                peaks.enter(name)
            t = reading()
            try:
                return fn(*args, **kwargs)
            finally:
                grew = reading() - t
                totals[name] = totals.get(name, 0.0) + grew
                calls.setdefault(name, []).append(grew)
                if peaks is not None:
                    peaks.exit(name)
        return measured

    try:
        with phases_wrapped(measuring):
            yield totals, calls
    finally:
        if "backward" in totals:  # the rows are recorded inside the backward tracer's body: counted once
            totals["backward"] -= totals.get("record_rows", 0.0)


@contextlib.contextmanager
def phase_times(device: torch.device, peaks: PhasePeaks | None = None) -> Iterator[dict[str, float]]:
    """Seconds spent in each stage of the ``attribute`` calls inside (:data:`PHASES`; the device synchronised at
    each stage's end, so a stage's kernels count in it): the split of a batch's time above the floor
    (``backward`` without ``record_rows``, which runs inside it). ``peaks``: as :func:`phase_totals`."""
    def clock() -> float:
        sync(device)
        return time.perf_counter()

    with phase_totals(clock, peaks) as (times, _):
        yield times


def attribution(rm: ReplacementModel, hf: Any, tokens: list[int], batch: int, rows: int, repeats: int,
                vocab: int, out: list[dict[str, Any]], flush: Any, warmup: int = 0,
                cap_bytes: int | None = None, snapshot_entries: int = 0,
                profile_top: int = 0) -> list[dict[str, Any]]:
    """(d): per prompt length, measured peak device memory vs ``estimate_memory`` and time per batch vs floor
    (each row appended to ``out`` and written with ``flush()`` as soon as it is measured); ``warmup`` untimed
    ``attribute`` calls first. ``phases``: the seconds of each stage of the timed call (:func:`phase_times`;
    ``other``: the rest — options, the scheduler, the trace's set-up, the gc). ``cap_bytes`` (``--offload`` with
    ``--cap-gb`` on CUDA): ``estimate_memory`` and ``attribute`` get ``max_memory`` = the cap minus what is
    allocated just before them, so that the batch and where the offloaded rows live (``offload_rows``, recorded) are
    decided for the card the cap stands for, not the larger one it runs on — the estimate is the one of the call's
    plan (``estimate_memory(max_memory=)``: the same ``budget.plan_call``), and ``estimate_is_call_plan`` records
    that the call kept to it (its batch and rows placement).

    ``phase_peaks`` (CUDA; None on the CPU, where the only allocation-level peak is the profiler's, which would
    slow the timed call): per stage of :data:`PHASES`, the peak device memory reached inside it, above what was
    allocated before the call, and ``between`` (outside every stage) — the largest of them is
    ``device_peak_above_resident`` (:class:`benchmarks._device_peaks.PhasePeaks`; the peak counter is reset at each
    stage boundary). ``snapshot_entries`` > 0 (``--memory-snapshot``, CUDA): the timed call runs under
    ``torch.cuda.memory._record_memory_history`` (Python stacks, a ring buffer of that many entries; the call is
    slower, its ``seconds`` not comparable) and ``memory_snapshot`` records the allocations live at the call's peak
    grouped by their innermost ``nnsight_lorsa`` frame, the 20 largest (:func:`benchmarks._device_peaks.
    snapshot_peak_summary`; ``truncated``: the buffer was full, its earliest entries lost)."""
    from nnsight_lorsa import attribute
    from nnsight_lorsa.attribution import estimate_memory

    dev = next(hf.parameters()).device
    resident = peak_bytes(dev)
    for n in tokens:
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator(device="cpu").manual_seed(n))
        progress(f"(d) {n} tokens: the floor")
        floor, floor_batch = attribution_floor(hf, ids, batch, repeats)
        former_floor, _ = attribution_floor(hf, ids, batch, repeats, weight_grads=True)
        before = int(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else None
        max_memory = None if cap_bytes is None or before is None else cap_bytes - before
        progress(f"(d) {n} tokens: estimate_memory")
        est = estimate_memory(rm, ids, batch_size=batch, max_feature_nodes=rows, max_memory=max_memory)
        progress(f"(d) {n} tokens: attribute")
        peak_reset(dev)
        host_before = host_peak_reset()
        try:
            for _ in range(warmup):
                attribute(rm, ids, batch_size=batch, max_feature_nodes=rows, max_memory=max_memory)
                gc.collect()
            sync(dev)
            tracker = None
            if dev.type == "cuda":
                tracker = PhasePeaks(lambda: int(torch.cuda.max_memory_allocated(dev)),
                                     lambda: torch.cuda.reset_peak_memory_stats(dev), base=before or 0)
                tracker.start()
            recording = snapshot_entries > 0 and dev.type == "cuda"
            if recording:
                torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=snapshot_entries)
            try:
                with phase_times(dev, tracker) as phases, reporting(phases):
                    t = time.perf_counter()
                    graph = attribute(rm, ids, batch_size=batch, max_feature_nodes=rows, max_memory=max_memory)
                    sync(dev)
                    seconds = time.perf_counter() - t
                snapshot = None
                if recording:
                    snapshot = snapshot_peak_summary(torch.cuda.memory._snapshot(), top=20,
                                                     max_entries=snapshot_entries)
            finally:
                if recording:
                    torch.cuda.memory._record_memory_history(enabled=None)
        except torch.cuda.OutOfMemoryError as e:
            out.append({"tokens": n, "error": f"OutOfMemoryError: {e}"[:300],
                        "estimate_device_bytes": est.device_bytes})
            flush()
            continue
        phase_peaks = None
        if tracker is not None:
            phase_peaks = tracker.finish()
            # the overall peak since peak_reset: the warm-up calls' and every phase's (the counter was reset inside)
            peak = (before or 0) + max(tracker.before or 0, tracker.overall or 0)
        else:
            peak = peak_bytes(dev)
        kernel_profile = None
        if profile_top > 0:  # one more call, under the profiler (slower: not the timed one)
            progress(f"(d) {n} tokens: attribute under the profiler")
            kernel_profile = profile_table(
                functools.partial(attribute, rm, ids, batch_size=batch, max_feature_nodes=rows,
                                  max_memory=max_memory), dev, runs=1, top=profile_top, warmup=False)
        offload_rows, used_batch = graph.meta["offload_rows"], graph.meta["batch_size"]
        n_rows = int(graph.feature_rows.sum())  # every computed row: features and logits
        batches = -(-n_rows // used_batch)
        # what grows with the rows (each batch's backward, its rows recorded, the rankings, the assembly of every
        # stored row) apart from what the call pays once (the clean pass and layout, the frozen forward, the rest):
        # the per-row cost of a graph of many rows, which a call of a few dozen rows hides under its fixed part
        per_batch = sum(phases.get(k, 0.0) for k in ("backward", "record_rows", "next_rows_influence", "assemble")
                        ) / batches
        out.append({
            "tokens": n, "seconds": seconds, "target_rows": n_rows, "batches": batches,
            "seconds_per_batch": seconds / batches, "floor_seconds_per_batch": floor,
            "floor_measured_at_batch": floor_batch,
            "per_row_vs_floor": None if floor is None else seconds / batches / floor,
            "steady_seconds_per_batch": per_batch, "fixed_seconds": seconds - per_batch * batches,
            "steady_per_row_vs_floor": None if floor is None else per_batch / floor,
            "former_floor_seconds_per_batch": former_floor,  # with weight gradients: the floor before 2026-11-27
            "per_row_vs_former_floor": None if former_floor is None else seconds / batches / former_floor,
            "device_peak_above_resident": None if peak is None or before is None else peak - before,
            "estimate_device_bytes": est.device_bytes, "estimate_host_bytes": est.host_bytes,
            "estimate_terms": dict(est.terms),  # which term a measured / estimate gap is in
            "resident_bytes": resident, "edge_sum_error_max": float(graph.edge_sum_error("mass").max()),
            "host_peak_above_start": None if host_before is None else host_peak() - host_before,
            "phases": {**phases, "other": seconds - sum(phases.values())}, "warmup_calls": warmup,
            "phase_peaks": phase_peaks, "memory_snapshot": snapshot, "kernel_profile": kernel_profile,
            "offload_rows": offload_rows, "offload_rows_kept_bytes": graph.meta.get("offload_rows_kept_bytes"),
            "batch_size": used_batch, "max_memory": max_memory,
            # the stored rows kept on the device for the ranking (SparseRows' mirror), kept / planned
            "ranking_mirror_bytes": graph.meta.get("ranking_mirror_bytes"),
            "ranking_mirror_planned": est.terms.get("ranking_mirror"),
            "estimate_is_call_plan": (offload_rows, used_batch, graph.meta.get("offload_rows_kept_bytes"))
            == (est.offload_rows, est.batch_size, est.offload_rows_kept_bytes),
        })
        flush()
        del graph
    return out


def main() -> None:
    args = parser(__doc__, scale=arg("8b", choices=sorted(SCALES)), device="cuda", dtype="bfloat16",
                  tokens=arg(nargs="+", type=int, default=[512, 1024, 2048, 4096]), seq=2048, repeats=5,
                  train_steps=5, attr_batch=4, attr_rows=64, skip=arg(nargs="*", default=[], type=str,
                                                                       help="parts to skip: a b c d"),
                  tf32=arg(False, action="store_true", help="(c) also with TF32 matmuls"),
                  attr_lorsa=arg("all", type=str, help="layers with a Lorsa in (d): 'all' or one layer number"),
                  offload=arg(False, action="store_true",
                              help="(d) with the Lorsas and transcoders offloaded to the host (pinned)"),
                  cap_gb=arg(0.0, help="cap this process's device memory at this many GB "
                                      "(torch.cuda.set_per_process_memory_fraction): an 80 GB H100 on a larger card"),
                  attr_warmup=arg(0, help="(d): untimed attribute calls before the timed one"),
                  memory_snapshot=arg(0, type=int, nargs="?", const=1_000_000,
                                      help="(d), CUDA: record the timed call's allocations (a ring buffer of this "
                                           "many, default 1e6) and the live ones at its peak by nnsight_lorsa "
                                           "frame (slows the call)"),
                  profile_kernels=arg(0, type=int, nargs="?", const=30,
                                      help="(d): one more attribute call per length under torch.profiler; its top "
                                           "operators (default 30) by device time and by host CPU time in the row "
                                           "('kernel_profile')"),
                  shared_weights=arg(False, action="store_true",
                                     help="(d) with --offload: every layer's Lorsa (and transcoder) shares the first "
                                          "one's pinned host weights (built and pinned once: ~5 s instead of "
                                          "~200 s at the 8B shape); the device side is the same"),
                  out=arg(None, type=str)).parse_args()
    start(args)
    s, dev, dt = SCALES[args.scale], torch.device(args.device), getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if args.cap_gb and dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total), dev.index or 0)
    result: dict[str, Any] = {"cap_gb": args.cap_gb or None, "scale": args.scale, "shapes": s, "device": name,
                              "dtype": args.dtype, "torch": torch.__version__,
                              "command": "python " + " ".join(sys.argv)}
    safe = "".join(c if c.isalnum() else "_" for c in name)
    path = args.out or RESULTS / f"gpu_scale_{args.scale}_{safe}.json"

    def flush() -> None:  # written after every part, so a run stopped by a time limit keeps what it measured
        write_json(path, result)

    model, hf = build(s, dev, dt)
    adapter = get_adapter(model)
    layer = s["layer"]
    lorsa = paper_lorsa(s, adapter, hf, layer, dev, dt)
    result["lorsa_bytes"] = sum(p.numel() * p.element_size() for p in lorsa.parameters())
    seq = min(args.seq, s["train_seq"]) if args.scale != "8b" else args.seq
    x = torch.randn(s["batch_fwd"], seq, s["d_model"], device=dev, dtype=dt)
    if "a" not in args.skip:
        result["a_forward_vs_floor"] = forward_vs_floor(lorsa, x, args.repeats)
        print("(a) Lorsa forward / floor:", round(result["a_forward_vs_floor"]["ratio"], 3))
        flush()
    ids = torch.randint(0, s["vocab"], (s["batch_fwd"], seq), generator=torch.Generator(device="cpu").manual_seed(1))
    lorsas = LorsaSet(model, {layer: lorsa})
    if "b" not in args.skip:
        result["b_replace_vs_trace"] = replace_vs_trace(model, lorsas, ids, layer, args.repeats)
        print("(b) replace / plain trace:", round(result["b_replace_vs_trace"]["ratio"], 3))
        flush()
    if "c" not in args.skip:
        # an fp32 Lorsa with fp32 matmuls, then (--tf32) the same run with TF32 ones
        # (torch.set_float32_matmul_precision("high")), then with a bf16 model a bf16 Lorsa (trained through fp32
        # master weights, training/master_weights.py; the Trainer refuses fp16 modules)
        runs = [("c_training", "highest", torch.float32)] + ([("c_training_tf32", "high", torch.float32)]
                                                              if args.tf32 else [])
        if dt == torch.bfloat16:
            runs.append(("c_training_bfloat16_masters", "highest", dt))
        for key, precision, train_dtype in runs:
            torch.set_float32_matmul_precision(precision)
            try:
                trained = paper_lorsa(s, adapter, hf, layer, dev, train_dtype)
                result[key] = training(model, hf, trained, s, args.train_steps)
                print(f"(c) {key} tokens/s:", {k: round(v) for k, v in result[key].items() if k.startswith("tokens")})
                flush()
                del trained
            finally:
                torch.set_float32_matmul_precision("highest")
    if "d" not in args.skip:
        from nnsight_lorsa.modules import Transcoder, TranscoderConfig

        lorsa_layers = range(s["n_layers"]) if args.attr_lorsa == "all" else [int(args.attr_lorsa)]
        result["d_lorsa_layers"] = list(lorsa_layers)
        result["d_offload"] = args.offload
        result["d_rows"] = args.attr_rows  # the feature budget: a run of another one has its own key in the record
        all_lorsas, tcs = LorsaSet(model), TranscoderSet(model)
        all_lorsas.offload = tcs.offload = args.offload  # offloaded: each module to the host once inserted
        progress(f"(d) building {len(lorsa_layers)} Lorsa(s) and {s['n_layers']} transcoders"
                 + (" (offloaded as built)" if args.offload else ""))
        if args.shared_weights and not args.offload:
            raise SystemExit("--shared-weights needs --offload (resident copies would misstate the device memory)")
        result["d_shared_weights"] = args.shared_weights
        result["d_memory_snapshot"] = bool(args.memory_snapshot) and dev.type == "cuda"  # its rows' own key

        def shared(first: Any, module: Any) -> Any:  # ``module`` (built on meta) on ``first``'s pinned host tensors
            module.load_state_dict(first.state_dict(), assign=True)
            return module

        for L in lorsa_layers:
            if layer == L:
                all_lorsas[L] = lorsa
            elif args.shared_weights and len(all_lorsas):
                first = all_lorsas[next(iter(all_lorsas))]
                cfg = dataclasses.replace(first.cfg, layer=L)
                all_lorsas[L] = shared(first, Lorsa(cfg, device="meta", dtype=dt))
            else:
                all_lorsas[L] = paper_lorsa(s, adapter, hf, L, dev, dt)
        progress("(d) Lorsas built")
        for L in range(s["n_layers"]):
            tc_cfg = TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                      activation_params={"k": s["k_tc"]}, layer=L)
            if args.shared_weights and L > 0:
                tcs[L] = shared(tcs[0], Transcoder(tc_cfg, device="meta", dtype=dt))
            else:
                tcs[L] = Transcoder(tc_cfg, device=dev, dtype=dt)
        progress("(d) transcoders built")
        result["d_module_bytes"] = sum(t.numel() * t.element_size() for m in [*all_lorsas.values(), *tcs.values()]
                                       for t in m.parameters())
        rm = ReplacementModel(model, lorsas=all_lorsas, transcoders=tcs)
        peak_reset(dev)
        result["d_attribution"] = []
        cap = int(args.cap_gb * 1e9) if args.offload and args.cap_gb and dev.type == "cuda" else None
        attribution(rm, hf, args.tokens, args.attr_batch, args.attr_rows, args.repeats, s["vocab"],
                    result["d_attribution"], flush, warmup=args.attr_warmup, cap_bytes=cap,
                    snapshot_entries=args.memory_snapshot, profile_top=args.profile_kernels)
        for row in result["d_attribution"]:
            print("(d)", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    flush()
    print("wrote", path)


if __name__ == "__main__":
    main()
