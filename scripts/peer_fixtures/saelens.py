"""SAELens fixtures, written by sae-lens itself (run in a venv with ``sae-lens`` installed, never
nnsight-lorsa)::

    python -m venv V; V/bin/pip install torch==2.13.0; V/bin/pip install sae-lens
    V/bin/python scripts/peer_fixtures/saelens.py OUT_DIR

One folder per case under ``OUT_DIR``: the files SAELens's own ``save_model`` wrote (``cfg.json``,
``sae_weights.safetensors``; trainer checkpoints also ``activation_scaler.json``, maybe
``activation_whitening.safetensors``, ``sparsity.safetensors``) and ``reference.safetensors``:
``x (8, d_in)`` and SAELens's own ``feature_acts = sae.encode(x)``, ``sae_out = sae.forward(x)``,
``l0 = (feature_acts != 0).sum(-1)``. For training checkpoints the reference is the inference SAE
SAELens makes of them (``save_inference_model`` -> ``SAE.load_from_disk``, after folding what its
trainer folds at the end: the activation scaling factor or whitening). The trainer's pickled
``trainer_state.pt`` is deleted (no pickles in fixtures).

Reverse direction: each ``OUT_DIR/reverse/<case>/`` (written by OUR ``save(..., format="saelens")``
with ``ours_outputs.safetensors``) is loaded with ``SAE.load_from_disk`` and compared;
``OUT_DIR/reverse/result.json`` records the result.
"""

from __future__ import annotations

import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    fixed_inputs,
    fresh_output_dir,
    randomize_,
    run_reverse,
    save_reference,
)
from sae_lens import SAE  # noqa: E402
from sae_lens.registry import get_sae_class, get_sae_training_class  # noqa: E402
from sae_lens.saes.sae import TrainingSAE  # noqa: E402

D_IN, D_SAE, D_OUT, K = 16, 48, 12, 4
HOOK = "blocks.1.hook_resid_post"


def _metadata() -> dict[str, Any]:
    return {"hook_name": HOOK, "model_name": "tiny-random"}


@torch.no_grad()
def _outputs(sae: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
    sae.eval()
    acts = sae.encode(x)
    return {"x": x, "feature_acts": acts, "sae_out": sae(x), "l0": (acts != 0).sum(-1)}


def _randomize(sae: Any, seed: int) -> None:
    randomize_(sae, seed=seed)
    with torch.no_grad():
        for name in ("threshold", "topk_threshold"):
            t = getattr(sae, name, None)
            if isinstance(t, torch.Tensor):
                t.abs_().mul_(0.5)
        if hasattr(sae, "log_threshold"):
            sae.log_threshold.fill_(-1.5)


def inference(out: Path, name: str, arch: str, seed: int, **cfg: Any) -> None:
    """An inference SAE of ``arch`` saved by ``SAE.save_model``; reference from ``SAE.load_from_disk``."""
    cls, cfg_cls = get_sae_class(arch)
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **cfg))
    sae.cfg.metadata.hook_name = HOOK
    _randomize(sae, seed)
    case = out / name
    sae.save_model(case)
    again = SAE.load_from_disk(case)
    ref = _outputs(again, fixed_inputs(D_IN))
    save_reference(case, **ref)


def inference_expected_average(out: Path, seed: int) -> None:
    """``normalize_activations="expected_average_only_in"``: the file is unfolded; the reference
    folds ``s`` with SAELens's ``fold_activation_norm_scaling_factor`` (what ``from_pretrained``
    does with the factor its registry records)."""
    cls, cfg_cls = get_sae_class("standard")
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, normalize_activations="expected_average_only_in"))
    sae.cfg.metadata.hook_name = HOOK
    _randomize(sae, seed)
    case = out / "norm_expected_average_only_in"
    sae.save_model(case)
    again = SAE.load_from_disk(case)
    s = 2.5
    again.fold_activation_norm_scaling_factor(s)
    ref = _outputs(again, fixed_inputs(D_IN))
    save_reference(case, **ref, norm_scaling_factor=torch.tensor(s))


def training(out: Path, name: str, arch: str, seed: int, **cfg: Any) -> None:
    """A training SAE saved by ``TrainingSAE.save_model``; reference: its inference SAE."""
    cls, cfg_cls = get_sae_training_class(arch)
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **cfg))
    sae.cfg.metadata.hook_name = HOOK
    _randomize(sae, seed)
    case = out / name
    sae.save_model(case)
    again = TrainingSAE.load_from_disk(case)
    save_reference(case, **_inference_outputs(again))


def _inference_outputs(tsae: Any) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        tsae.save_inference_model(tmp)
        sae = SAE.load_from_disk(tmp)
        return _outputs(sae, fixed_inputs(D_IN))


def trainer_run(out: Path, name: str, arch: str, normalize: str, seed: int, **cfg: Any) -> None:
    """SAELens's own ``SAETrainer`` on random activations: a mid-run checkpoint (unfolded, with its
    ``activation_scaler.json`` and whitening file) and the final one (folded). Each checkpoint's
    reference is what the trainer's end-of-run fold makes of it."""
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activation_scaler import ActivationScaler
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(seed)
    cls, cfg_cls = get_sae_training_class(arch)
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, normalize_activations=normalize, **cfg))
    sae.cfg.metadata.hook_name = HOOK
    mix = torch.randn(D_IN, D_IN) * 0.5 + torch.eye(D_IN) * 2

    def data():
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randn(32, D_IN, generator=g) @ mix + 1.0

    run = out / name
    trainer_cfg = SAETrainerConfig(total_training_samples=32 * 6, train_batch_size_samples=32, lr=1e-3, lr_end=1e-3,
                                   n_checkpoints=1, checkpoint_path=str(run), save_final_checkpoint=True,
                                   n_batches_for_norm_estimate=4, dead_feature_window=2, feature_sampling_window=3)
    SAETrainer(trainer_cfg, sae, data()).fit()
    for ckpt in sorted(p for p in run.iterdir() if p.is_dir()):
        for junk in ("trainer_state.pt", "activations_store_state.safetensors", "runner_cfg.json"):
            (ckpt / junk).unlink(missing_ok=True)
        tsae = TrainingSAE.load_from_disk(ckpt)
        scaler = ActivationScaler()
        if (ckpt / "activation_scaler.json").is_file():
            scaler.load(ckpt / "activation_scaler.json")
        if scaler.scaling_factor is not None and tsae.cfg.normalize_activations == "expected_average_only_in":
            tsae.fold_activation_norm_scaling_factor(scaler.scaling_factor)
        if scaler.whitening is not None and tsae.cfg.normalize_activations == "covariance_whitening":
            w = scaler.whitening
            tsae.fold_activation_whitening(mean=w.mean, whitening_matrix=w.matrix, unwhitening_matrix=w.inverse_matrix)
        save_reference(ckpt, **_inference_outputs(tsae))


def legacy(out: Path, seed: int) -> None:
    """Pre-6.0 ``cfg.json`` layouts (flat keys, ``hook_point``, ``activation_fn_str``, no version: what SAELens ≤ 5
    and the 2024 ``GPT2-Small-SAEs-Reformatted`` folders hold), made by rewriting the config of a folder SAELens
    saved; the reference is what SAELens's own reader (``handle_pre_6_0_config``) makes of each."""
    cls, cfg_cls = get_sae_class("topk")
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, k=K))
    _randomize(sae, seed)
    flat = {"d_in": D_IN, "d_sae": D_SAE, "dtype": "torch.float32", "device": "cpu", "hook_point": HOOK,
            "hook_point_layer": 1, "hook_point_head_index": None, "model_name": "tiny-random", "context_size": 16}
    cases = {
        # SAELens <= 5 wrote TopK SAEs as architecture "standard" with activation_fn_kwargs.k
        "legacy_standard_named_topk": {**flat, "architecture": "standard", "activation_fn_str": "topk",
                                       "activation_fn_kwargs": {"k": K}},
        # a top-level k that activation_fn_kwargs.k overrides on this path
        "legacy_topk_kwargs_k": {**flat, "architecture": "topk", "k": K + 3, "activation_fn": "topk",
                                 "activation_fn_kwargs": {"k": K}},
        "legacy_relu_scaling_factor_ones": {**flat, "activation_fn_str": "relu", "finetuning_scaling_factor": False},
        # the control: a 6.x file says what it is (SAELens reads this one as a plain ReLU SAE)
        "v6_standard_with_topk_kwargs": {"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32",
                                         "apply_b_dec_to_input": True, "normalize_activations": "none",
                                         "activation_fn": "topk", "activation_fn_kwargs": {"k": K},
                                         "metadata": {"sae_lens_version": "6.54.12", "hook_name": HOOK}},
    }
    for name, cfg in cases.items():
        case = out / name
        sae.save_model(case)
        (case / "cfg.json").write_text(json.dumps(cfg))
        if name.endswith("scaling_factor_ones"):  # spring-2024 files carried it; SAELens drops an all-ones one
            weights = load_file(str(case / "sae_weights.safetensors"))
            save_file({**weights, "scaling_factor": torch.ones(D_SAE)}, str(case / "sae_weights.safetensors"))
        save_reference(case, **_outputs(SAE.load_from_disk(case), fixed_inputs(D_IN)))


def registry(out: Path) -> None:
    """``registry/pretrained_saes.yaml``: entries copied from the installed SAELens's release registry
    (the first SAE or two of a few releases: one with ``norm_scaling_factor`` s, one with
    ``config_overrides``, two that need converters) plus ``tiny-random-saes``, a release of two of
    the cases above whose ``norm_scaling_factor`` is the ``s`` their reference folded. ``repo_id``
    ``LOCAL/…``: the test points it at a local directory laid out as the hub repo."""
    from importlib.resources import files

    import yaml

    data = yaml.safe_load(files("sae_lens").joinpath("pretrained_saes.yaml").read_text())
    keep = {name: {**data[name], "saes": data[name]["saes"][:n]} for name, n in (
        ("gpt2-small-mlp-tm", 2), ("gpt2-small-attn-out-v5-32k", 1), ("gemma-scope-2b-pt-res-canonical", 1),
        ("gpt2-small-hook-z-kk", 1))}
    saes = [{"id": HOOK, "path": "norm_expected_average_only_in", "norm_scaling_factor": 2.5},
            {"id": f"{HOOK}.topk", "path": "topk_rescale"}]
    keep["tiny-random-saes"] = {"conversion_func": None, "model": "tiny-random", "repo_id": "LOCAL/tiny-random-saes",
                                "saes": saes}
    (out / "registry").mkdir()
    header = f"# written by scripts/peer_fixtures/saelens.py from sae-lens {version('sae-lens')}'s registry\n"
    (out / "registry" / "pretrained_saes.yaml").write_text(header + yaml.safe_dump(keep, sort_keys=True))


def reverse(out: Path) -> None:
    """Load each case our ``save(..., format="saelens")`` wrote in SAELens and compare."""
    def load_and_run(case: Path, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
        sae = SAE.load_from_disk(case)
        return _outputs(sae, x), {"architecture": sae.cfg.architecture()}

    run_reverse(out, load_and_run)


def main(out: Path) -> None:
    fresh_output_dir(out)
    seed = iter(range(1000))
    inference(out, "standard", "standard", next(seed), apply_b_dec_to_input=True)
    inference(out, "standard_no_b_dec_in", "standard", next(seed), apply_b_dec_to_input=False)
    inference(out, "gated", "gated", next(seed))
    inference(out, "jumprelu", "jumprelu", next(seed))
    for rescale in (False, True):
        for b_dec in (True, False):
            tag = ("_rescale" if rescale else "") + ("" if b_dec else "_no_b_dec_in")
            inference(out, f"topk{tag}", "topk", next(seed), k=K, apply_b_dec_to_input=b_dec,
                      rescale_acts_by_decoder_norm=rescale)
    inference(out, "abstopk", "abstopk", next(seed), k=K)
    inference(out, "abstopk_rescale", "abstopk", next(seed), k=K, rescale_acts_by_decoder_norm=True)
    for arch in ("transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder"):
        inference(out, arch, arch, next(seed), d_out=D_OUT, apply_b_dec_to_input=False)
    for norm in ("layer_norm", "constant_norm_rescale", "covariance_whitening"):
        inference(out, f"norm_{norm}", "standard", next(seed), normalize_activations=norm)
    inference(out, "norm_layer_norm_topk", "topk", next(seed), k=K, normalize_activations="layer_norm")
    inference_expected_average(out, next(seed))  # s = 2.5, as registry() records
    for arch, extra in (("temporal", {"n_heads": 2, "bottleneck_factor": 2}),
                        ("matching_pursuit", {"max_iterations": 4})):
        try:
            inference(out, arch, arch, next(seed), **extra)
        except Exception as e:  # no per-token reference (e.g. temporal reads whole sequences): the
            print(f"{arch}: files only, no reference ({type(e).__name__}: {e})")  # files are kept
    training(out, "train_standard", "standard", next(seed))
    training(out, "train_gated", "gated", next(seed))
    training(out, "train_jumprelu", "jumprelu", next(seed))
    training(out, "train_topk", "topk", next(seed), k=K)
    training(out, "train_abstopk", "abstopk", next(seed), k=K)
    training(out, "train_batchtopk", "batchtopk", next(seed), k=K)
    training(out, "train_matryoshka_batchtopk", "matryoshka_batchtopk", next(seed), k=K,
             matryoshka_widths=[16, 32, D_SAE])
    trainer_run(out, "trainer_topk_expected_average", "topk", "expected_average_only_in", next(seed), k=K)
    trainer_run(out, "trainer_standard_whitening", "standard", "covariance_whitening", next(seed))
    # TopK rescaled by the decoder norm: SAELens folds that norm before the whitening (TopKSAE.fold_activation_
    # whitening); added 2026-11-29 with the seed after the others, so the cases above keep theirs
    registry(out)
    trainer_run(out, "trainer_topk_rescale_whitening", "topk", "covariance_whitening", next(seed), k=K,
                rescale_acts_by_decoder_norm=True)
    legacy(out, next(seed))
    (out / "peer.json").write_text(json.dumps({"peer": "sae-lens", "version": version("sae-lens"),
                                               "torch": torch.__version__}, indent=1) + "\n")
    reverse(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))
