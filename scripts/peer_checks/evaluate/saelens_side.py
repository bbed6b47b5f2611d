"""SAELens's side of the ``evaluate`` check, run by ``run.py`` with the SAELens venv's interpreter (sae-lens 6.54.12,
transformer-lens 3.9.0; never nnsight-lorsa)::

    python saelens_side.py WORK

Writes the three SAEs with SAELens's own ``save_model`` (random weights, ``_shared.randomize_`` over SAELens's
parameters in its ``named_parameters()`` order) into ``WORK/saes/<name>/``, reloads them with ``SAE.load_from_disk``
and runs ``sae_lens.evals.run_evals`` on a TransformerLens copy of the HF GPT-2 (unfolded, uncentred weights) over the
six windows in one batch, twice: ``exclude_special_tokens=False`` (``noexcl``; the same as the default ``True`` on this
tokenizer-less model) and ``exclude_special_tokens=[BOS, pad]`` (``excl_bos_pad``: what the default does with a
tokenizer whose special ids are these). Writes ``WORK/saelens/results.json`` (metrics and ``feature_density`` per SAE
and run) and ``WORK/saelens/<name>_raw.safetensors`` (TransformerLens's hook value ``x``, ``z``, ``out``, the logits
original / spliced everywhere / zero-ablated), which ``run.py`` compares with ours as a TL-vs-HF consistency check.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _shared
import torch
import transformers
from sae_lens import SAE
from sae_lens.evals import get_eval_everything_config, run_evals
from sae_lens.registry import get_sae_class
from sae_lens.training.activation_scaler import ActivationScaler
from safetensors.torch import load_file, save_file
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights


class FixedStore:
    """The part of SAELens's ``ActivationsStore`` that ``run_evals`` uses: always the same windows."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.context_size = ids.shape[1]
        self.store_batch_size_prompts = ids.shape[0]

    def get_batch_tokens(self, n: int) -> torch.Tensor:
        return self.ids

    def reset_input_dataset(self) -> None:
        pass


def tl_copy(hf: Any) -> HookedTransformer:
    """The HF GPT-2 as a TransformerLens model (no folding, no centring, no BOS prepended)."""
    c = hf.config
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions,
                                  d_head=c.n_embd // c.n_head, n_heads=c.n_head, d_mlp=4 * c.n_embd,
                                  d_vocab=c.vocab_size, act_fn="gelu_new", normalization_type="LN",
                                  eps=c.layer_norm_epsilon, original_architecture="GPT2LMHeadModel",
                                  default_prepend_bos=False)
    tl = HookedTransformer(cfg)
    tl.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False)
    return tl.eval()


def write_sae(work: Path, name: str) -> tuple[SAE, list[str]]:
    """SAE ``name`` drawn, written by SAELens and reloaded; also SAELens's parameter order."""
    arch, hook, extra, _, seed = _shared.SAE_CASES[name]
    cls, cfg_cls = get_sae_class(arch)
    sae = cls(cfg_cls(d_in=_shared.D_MODEL, d_sae=_shared.D_SAE, **extra))
    sae.cfg.metadata.hook_name = hook
    tensors = dict(list(sae.named_parameters()) + list(sae.named_buffers()))
    _shared.randomize_(tensors, list(tensors), seed)
    sae.save_model(str(_shared.sae_dir(work, name)))
    return SAE.load_from_disk(str(_shared.sae_dir(work, name))).eval(), list(tensors)


def splice_hook(sae: SAE) -> Any:
    """A TransformerLens hook replacing the value by the SAE's reconstruction at every position."""
    return lambda act, hook: sae.decode(sae.encode(act))


def zero_hook(act: torch.Tensor, hook: Any) -> torch.Tensor:
    return torch.zeros_like(act)


@torch.no_grad()
def main(work: Path) -> None:
    out_dir = _shared.side_dir(work, "saelens")
    hf = transformers.GPT2LMHeadModel.from_pretrained(_shared.model_dir(work)).eval()
    tl = tl_copy(hf)
    ids = load_file(_shared.tokens_file(work))["input_ids"]
    tl_vs_hf = float((tl(ids) - hf(ids).logits).abs().max())
    eval_cfg = get_eval_everything_config(batch_size_prompts=ids.shape[0], n_eval_reconstruction_batches=1,
                                          n_eval_sparsity_variance_batches=1)
    results: dict[str, Any] = {}
    for name, (arch, hook, *_) in _shared.SAE_CASES.items():
        sae, order = write_sae(work, name)
        runs = {}
        for label, exclude in (("noexcl", False), ("excl_bos_pad", _shared.EXCLUDED_IDS)):
            metrics, feature_metrics = run_evals(sae, FixedStore(ids), tl, ActivationScaler(), eval_cfg,
                                                 exclude_special_tokens=exclude)
            runs[label] = {"metrics": metrics, "feature_density": feature_metrics["feature_density"]}
        _, cache = tl.run_with_cache(ids, names_filter=[hook])
        x = cache[hook]
        z = sae.encode(x)
        spliced = tl.run_with_hooks(ids, fwd_hooks=[(hook, splice_hook(sae))])
        zeroed = tl.run_with_hooks(ids, fwd_hooks=[(hook, zero_hook)])
        save_file({"x": x.contiguous(), "z": z.contiguous(), "out": sae.decode(z).contiguous(), "logits_orig": tl(ids),
                   "logits_spliced": spliced, "logits_zero": zeroed}, out_dir / f"{name}_raw.safetensors")
        results[name] = {"arch": arch, "hook": hook, "param_order": order, **runs}
    _shared.write_json(out_dir / "results.json", {
        "versions": {p: version(p) for p in ("sae-lens", "transformer-lens", "transformers", "torch")},
        "tl_vs_hf_logits_max_abs": tl_vs_hf, "saes": results})


if __name__ == "__main__":
    _shared.setup()
    main(Path(sys.argv[1]))
