"""nnsight-lorsa's side of the ``evaluate`` check, run by ``run.py`` with our interpreter (nnsight-lorsa installed)::

    python ours_side.py WORK saes       # after the SAE files exist (written by SAELens, or by run.py without it)
    python ours_side.py WORK sparsify   # after sparsify_side.py wrote its SAE

``saes``: loads each SAE file with ``SAESet.from_pretrained`` (the ``hook_attn_out`` one placed by module path, the
others from the hook their file records) and runs ``evaluate`` over the six windows in one batch, with
``target_mask=None`` and ``target_mask=attention_mask``; ``evaluate`` of ``relu_resid0`` with the holed mask
(``holes_mask``, batches of 4). Independently of ``evaluate``, forward hooks on the plain HF module record the site's
value ``y``, the loaded SAE's ``z = encode(y)`` and ``out = decode(z)``, and the logits original (``lo``), with the
SAE spliced at every position (``ls``), spliced everywhere except at BOS / pad ids (``ls_nospecial``, SAELens's
``exclude_special_tokens`` splice) and zero-ablated (``lz``): ``WORK/ours/<name>_raw.safetensors``, from which
``run.py`` recomputes every metric in plain torch. Results: ``WORK/ours/results.json``.

``sparsify``: ``evaluate`` (``target_mask=attention_mask``) of the SAE sparsify wrote, in batches of 6, 4 and 1 (ours
pools over batches: the result must not depend on the batch size): ``WORK/ours/sparsify_results.json``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _shared
import torch
from safetensors.torch import load_file, save_file

from nnsight_lorsa import SAESet, TokenDataset, evaluate
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.nnsight_internals import hf_module

Hook = Callable[[torch.nn.Module, Any, Any], Any]


def _value(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_value(output: Any, new: torch.Tensor) -> Any:
    return (new, *output[1:]) if isinstance(output, tuple) else new


def replacing(fn: Callable[[torch.Tensor], torch.Tensor]) -> Hook:
    """A forward hook replacing the module's (first) output ``v`` by ``fn(v)``."""
    return lambda module, args, output: _with_value(output, fn(_value(output)))


@torch.no_grad()
def logits_with(hf: torch.nn.Module, module: torch.nn.Module, ids: torch.Tensor, hook: Hook | None) -> torch.Tensor:
    """The HF model's logits on ``ids`` with ``hook`` on ``module`` (none: the original model)."""
    handle = module.register_forward_hook(hook) if hook is not None else None
    try:
        return hf(ids).logits
    finally:
        if handle is not None:
            handle.remove()


def load_sae_set(model: Any, work: Path, name: str) -> SAESet:
    _, hook, _, path, _ = _shared.SAE_CASES[name]
    src = str(_shared.sae_dir(work, name))
    return SAESet.from_pretrained(model, {path: src} if "attn" in hook else [src])


def git_head() -> str | None:
    """The commit of the checkout nnsight-lorsa is imported from (its working tree may differ)."""
    import nnsight_lorsa

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(nnsight_lorsa.__file__).parent, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_saes(work: Path) -> None:
    out_dir = _shared.side_dir(work, "ours")
    model = load_model(str(_shared.model_dir(work)))
    hf = hf_module(model)
    tok = load_file(_shared.tokens_file(work))
    ids, am = tok["input_ids"], tok["attention_mask"].bool()
    special = (ids == _shared.BOS_ID) | (ids == _shared.PAD_ID)
    results: dict[str, Any] = {}
    for name, (*_, path, _seed) in _shared.SAE_CASES.items():
        saes = load_sae_set(model, work, name)
        site = next(iter(saes))
        entry: dict[str, Any] = {"site": site}
        for label, mask in (("target_mask=None", None), ("target_mask=attention_mask", am)):
            entry[label] = evaluate(saes, TokenDataset(ids, target_mask=mask), batch_size=ids.shape[0],
                                    progress=False).to_dict()
        results[name] = entry

        sae, module = saes[site], hf.get_submodule(path)
        store: dict[str, torch.Tensor] = {}

        def grab(module: torch.nn.Module, args: Any, output: Any, store: dict[str, torch.Tensor] = store) -> None:
            store["y"] = _value(output).detach().clone()

        with torch.no_grad():
            raw = {"lo": logits_with(hf, module, ids, grab),
                   "ls": logits_with(hf, module, ids, replacing(sae)),
                   "ls_nospecial": logits_with(hf, module, ids, replacing(
                       lambda v, sae=sae: torch.where(special[..., None], v, sae(v)))),
                   "lz": logits_with(hf, module, ids, replacing(torch.zeros_like))}
            y = store["y"]
            z = sae.encode(y)
            out = sae.decode(z) if hasattr(sae, "decode") else sae(y)
        save_file({"y": y, "z": z.contiguous(), "out": out.contiguous(), **raw}, out_dir / f"{name}_raw.safetensors")

    holes = evaluate(load_sae_set(model, work, "relu_resid0"), TokenDataset(ids, target_mask=tok["holes_mask"]),
                     batch_size=4, progress=False).to_dict()
    _shared.write_json(out_dir / "results.json", {
        "versions": {p: version(p) for p in ("nnsight-lorsa", "nnsight", "transformers", "torch")},
        "git_head": git_head(), "saes": results, "holes_relu_resid0": holes})


def run_sparsify(work: Path) -> None:
    model = load_model(str(_shared.model_dir(work)))
    tok = load_file(_shared.tokens_file(work))
    ids, am = tok["input_ids"], tok["attention_mask"].bool()
    saes = SAESet.from_pretrained(model, str(_shared.side_dir(work, "sparsify") / "saes"))
    by_batch_size = {}
    for bs in (6, 4, 1):
        ev = evaluate(saes, TokenDataset(ids, target_mask=am), batch_size=bs, progress=False).to_dict()
        ev.pop("feature_density")
        by_batch_size[str(bs)] = ev
    _shared.write_json(_shared.side_dir(work, "ours") / "sparsify_results.json",
                       {"sites": list(saes), "by_batch_size": by_batch_size})


if __name__ == "__main__":
    _shared.setup()
    {"saes": run_saes, "sparsify": run_sparsify}[sys.argv[2]](Path(sys.argv[1]))
