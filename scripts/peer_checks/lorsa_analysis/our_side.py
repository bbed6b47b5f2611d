"""nnsight-lorsa's side of the Lorsa-analysis check, run by ``run.py`` in our environment after ``their_side.py``::

    python our_side.py MODEL_DIR CASE_DIR

Loads the Lorsa Llamascopium wrote in ``CASE_DIR/lorsa`` with ``LorsaSet.from_pretrained`` and, on their token
windows, computes with OUR code:

- ``x`` / ``z``: the Lorsa input read by nnsight (``envoy.read.attention_activations``) and the head activations
  (``Lorsa.forward(..., return_cache=True)``);
- ``zp``: ``Lorsa.z_pattern`` of every head on the first ``n_zp`` windows;
- the top activations: ``analysis.collect_top_activations`` (``n_top``, ``skip_start=1``, distinct windows; their
  right padding as ``attention_mask``) and, per
  head active on the corpus, the z-patterns ``viz.head_dashboard_data`` shows (``window = pos``: every key up to
  the query);
- the OV logit lens: ``analysis.ov_logit_lens`` with ``k = vocab`` (the whole row, re-scattered to token order).

Writes ``CASE_DIR/ours.safetensors`` and ``CASE_DIR/ours.json``.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nnsight_lorsa import LorsaSet, ReplacementModel
from nnsight_lorsa.analysis import collect_top_activations, ov_logit_lens
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.viz import head_dashboard_data


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model_dir, case = argv[0], Path(argv[1])
    theirs = load_file(str(case / "theirs.safetensors"))
    opts = json.loads((case / "theirs.json").read_text())["opts"]
    layer, tokens = opts["layer"], theirs["tokens"]
    # their right padding (``pad_rows``) as our attention mask; None without padding (the plain call)
    mask = (tokens != opts.get("pad", 1)).long() if opts.get("pad_rows") else None
    model = load_model(model_dir)
    lorsas = LorsaSet.from_pretrained(model, {layer: str(case / "lorsa")})
    lorsa = lorsas[layer]
    rm = ReplacementModel(model, lorsas=lorsas)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        act = attention_activations(model, layer, tokens)
        x = act.x.float()
        _, cache = lorsa(x, act.positions, return_cache=True)
        out["x"], out["z"] = x, cache.z.float()
        n_zp = opts.get("n_zp", 4)
        heads = list(range(lorsa.cfg.n_ov_heads))
        out["zp"] = torch.cat([lorsa.z_pattern(x[w:w + 1], heads, act.positions) for w in range(n_zp)]).float()
        out["W_O"] = lorsa.W_O.detach().float()

    n_top = opts.get("n_top", 6)
    top = collect_top_activations(rm, layer, tokens, n_top=n_top, skip_start=1, batch_size=opts.get("batch", 5),
                                  attention_mask=mask)
    out.update({"top_values": top.values, "top_window": top.window, "top_position": top.position,
                "count": top.count})
    dashboards = {}
    for h in top.top_heads(lorsa.cfg.n_ov_heads):
        data = head_dashboard_data(rm, layer, h, top, tokens, n_contexts=n_top, window=tokens.shape[1], lens_k=5,
                                   attention_mask=mask)
        dashboards[h] = [{"window": c["window"], "position": c["position"], "z": c["z"], "contrib": c["contrib"]}
                         for c in data["contexts"]]

    vocab = model.config.vocab_size
    vals, ids, _ = ov_logit_lens(rm, layer, None, k=vocab)
    out["lens"] = torch.zeros(vals.shape).scatter_(1, ids, vals)
    out["lens_top_ids"] = ids[:, :opts.get("lens_k", 10)]

    save_file({k: v.contiguous() for k, v in out.items()}, str(case / "ours.safetensors"))
    meta = {"n_tokens": top.n_tokens, "dashboards": dashboards,
            "decoder_norm_folded": bool(lorsa.cfg.extra.get("llamascopium", {}).get("decoder_norm_folded_by_loader")),
            "versions": {p: version(p) for p in ("nnsight-lorsa", "torch", "transformers")}}
    (case / "ours.json").write_text(json.dumps(meta))
    print("done", {k: tuple(v.shape) for k, v in out.items()}, "dashboards", len(dashboards))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
