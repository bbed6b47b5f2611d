"""Arguments of the wrong kind at the front door, run without the suite's beartype hook (as a researcher's process
runs them): ``python tests/wrong_kind_cases.py --json OUT`` writes one record per case, ``{"case", "error",
"message", "wrote"}`` (``error``: the exception's class name, None when the call returned). Read by
``tests/test_wrong_argument_kinds.py``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from helpers import LAYER, make_lorsa, make_sae, tiny_nnsight  # noqa: E402

from nnsight_lorsa import (  # noqa: E402
    LorsaSet,
    SAESet,
    TokenDataset,
    TrainConfig,
    Trainer,
    TranscoderSet,
    get_adapter,
    load,
    save,
)
from nnsight_lorsa.attribution import PruneConfig  # noqa: E402
from nnsight_lorsa.formats.registry import load_all  # noqa: E402
from nnsight_lorsa.sparse_attention import SparseTrainConfig  # noqa: E402


def cases(lorsa, model, scratch: Path) -> dict:
    sae = make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2})
    out = {
        "LorsaSet(model, [lorsa])": lambda: LorsaSet(model, [lorsa]),
        "LorsaSet(model, lorsa)": lambda: LorsaSet(model, lorsa),
        "LorsaSet(model, (layer, lorsa))": lambda: LorsaSet(model, (LAYER, lorsa)),
        "TranscoderSet(model, [lorsa])": lambda: TranscoderSet(model, [lorsa]),
        "SAESet(model, [sae])": lambda: SAESet(model, [sae]),
        "Trainer(sae, None, config)": lambda: Trainer(sae, None, TrainConfig(total_steps=2)),
        "Trainer(sae, 3, config)": lambda: Trainer(sae, 3, TrainConfig(total_steps=2)),
    }
    for label, path in (("None", None), ("3", 3), ("bytes", b"/tmp/x")):
        out[f"save(lorsa, {label})"] = lambda p=path: save(lorsa, p)
        out[f"load({label})"] = lambda p=path: load(p)
        out[f"load_all({label})"] = lambda p=path: load_all(p)
        out[f"LorsaSet.save({label})"] = lambda p=path: LorsaSet(model, {LAYER: lorsa}).save(p)
        out[f"LorsaSet.from_pretrained(model, {label})"] = lambda p=path: LorsaSet.from_pretrained(model, p)
        out[f"LorsaSet.from_pretrained(model, [{label}])"] = lambda p=path: LorsaSet.from_pretrained(model, [p])
    for label, value in (("None", None), ("Tensor", torch.zeros(2, 3, 8)), ("dict", {"x": torch.zeros(2, 3, 8)})):
        out[f"Trainer source returning {label}"] = (
            lambda v=value: Trainer(make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2}),
                                    lambda i: v, TrainConfig(total_steps=2)).train(progress=False))
    for name, value in (("batch_size", "x"), ("batch_size", 2.5), ("batch_size", True), ("seq_len", 2.5),
                        ("gate_lr", "x"), ("target_ce", "x"), ("target_batches", 2.5), ("seed", 2.5),
                        ("lora_rank", 2.5), ("bos_id", 2.5), ("allow_slack_constraint", "no"),
                        ("init_bias", "x"), ("target_margin", None)):
        out[f"SparseTrainConfig({name}={value!r})"] = lambda n=name, v=value: SparseTrainConfig(**{n: v})
    for name, value in (("node_threshold", "x"), ("edge_threshold", None), ("keep_mass", True)):
        out[f"PruneConfig({name}={value!r})"] = lambda n=name, v=value: PruneConfig(**{n: v})
    out["SAEConfig(hook=['model.layers.3'])"] = lambda: make_sae(d_in=8, d_sae=16, hook=["model.layers.3"])
    out["TokenDataset(tokens, target_mask=list)"] = lambda: TokenDataset(torch.ones(2, 4, dtype=torch.long),
                                                                          [[1, 1, 1, 1], [1, 1, 1, 0]])
    return out


def main(out_path: str) -> None:
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model), LAYER)
    records = []
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d)
        before = os.listdir(os.getcwd())
        for case, call in cases(lorsa, model, scratch).items():
            try:
                call()
                error, message = None, ""
            except Exception as e:  # noqa: BLE001 — recorded for the test
                error, message = type(e).__name__, str(e)
            records.append({"case": case, "error": error, "message": message,
                            "wrote": sorted(set(os.listdir(os.getcwd())) - set(before))})
    Path(out_path).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--json") + 1])
