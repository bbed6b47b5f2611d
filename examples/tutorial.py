# %% [markdown]
# # nnsight-lorsa in one sitting: replace -> patch -> attribute -> dashboard
#
# A walk through the package on the embedded tinyshakespeare Llama (4 layers, d_model 128, offline) with the
# packaged Lorsa (layer 2) and transcoders (layers 0-3). Run it as a script
# (`python examples/tutorial.py --out tutorial-out`, about a minute on 2 CPU cores) or open it as a notebook
# (the `# %%` cells: VS Code, Jupyter with jupytext). It writes an attribution-graph page, its
# Neuronpedia / circuit-tracer JSON and a head dashboard into `--out`, and prints what each step found.
# `tests/test_tutorial.py` runs it on every test run. Text: docs/tutorial.md.

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import nnsight
import torch

from nnsight_lorsa import LorsaSet, ReplacementModel, TokenDataset, TranscoderSet, attribute
from nnsight_lorsa.analysis import collect_top_activations, ov_logit_lens
from nnsight_lorsa.assets import default_corpus_path, default_lorsa_dir, default_transcoder_dir
from nnsight_lorsa.attribution import graph_scores, prune, save_neuronpedia
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.patching import LorsaHead, ablate
from nnsight_lorsa.viz import head_dashboard_data, render_html, write_dashboard

parser = argparse.ArgumentParser(description="replace -> patch -> attribute -> dashboard on the embedded model")
parser.add_argument("--out", type=Path, default=Path("tutorial-out"), help="where the pages go (default: %(default)s)")
parser.add_argument("--prompt", default="ROMEO:\nBut soft, what light", help="the prompt (default: %(default)r)")
parser.add_argument("--windows", type=int, default=64,
                    help="corpus windows the dashboard's top contexts come from (default: %(default)s)")
parser.add_argument("--seq-len", type=int, default=64, help="tokens per corpus window (default: %(default)s)")
args, _ = parser.parse_known_args()  # known only: a notebook kernel passes its own arguments
args.out.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## 1. Load: a model and its replacements
#
# `load_model()` is an nnsight `TransformersModel` of the embedded model. A `LorsaSet` holds Lorsas by layer,
# a `TranscoderSet` transcoders by layer; `ReplacementModel` bundles them with the model — the one argument of
# attribution, patching, analysis and dashboards. (`from_pretrained` also takes a Hub repo id, docs/hub.md.)

# %%
model = load_model()
lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir())
transcoders = TranscoderSet.from_pretrained(model, default_transcoder_dir())
rm = ReplacementModel(model, lorsas=lorsas, transcoders=transcoders)
print(lorsas, transcoders, sep="\n")

# %% [markdown]
# ## 2. Replace: the Lorsa in place of layer 2's attention, inside one trace
#
# `replace(layer=2)` swaps the MHSA output for the Lorsa's in this trace only and returns the Lorsa's envoy:
# its head activations `hook_z` (batch, pos, n_ov_heads) can be read and edited like any nnsight value.
# With `error=True` the exact residual MHSA − Lorsa is added back: the logits are the model's own.

# %%
with model.trace(args.prompt):
    site = lorsas.replace(layer=2)
    z = nnsight.save(site.hook_z.output)
    spliced = nnsight.save(model.lm_head.output)
with model.trace(args.prompt):
    lorsas.replace(layer=2, error=True)
    exact = nnsight.save(model.lm_head.output)
with model.trace(args.prompt):
    original = nnsight.save(model.lm_head.output)

last = z[0, -1].detach()
active = (last > 0).nonzero().flatten()
top_head = int(active[last[active].argmax()])
print(f"{len(active)} of {z.shape[-1]} Lorsa heads active on the last token; strongest: head {top_head}")
print("error term on: logits equal the model's:", torch.equal(exact, original),
      f"| without it, max |logit diff| {float((spliced - original).detach().abs().max()):.3f}")

# %% [markdown]
# ## 3. Patch: which of those heads does the prediction need?
#
# Inside `rm.trace`, `rm.replace()` splices every replacement with its error term (the model's own output), and
# `ablate(rm(target))` zeroes a checked target — here each active Lorsa head in turn; the edit propagates
# downstream. The head whose ablation moves the predicted token's log-probability most is the one we follow.

# %%
tokenizer = model.tokenizer
predicted = int(original[0, -1].argmax())
logp = float(original[0, -1].detach().log_softmax(-1)[predicted])
effects = {}
for head in active.tolist():
    with rm.trace(args.prompt):
        rm.replace()
        ablate(rm(LorsaHead(2, head)))
        ablated = nnsight.save(model.lm_head.output)
    effects[head] = float(ablated[0, -1].detach().log_softmax(-1)[predicted]) - logp
head = max(effects, key=lambda h: abs(effects[h]))
print(f"predicted next token {tokenizer.decode([predicted])!r} (log-prob {logp:.3f}); ablating head {head} "
      f"moves it most: {effects[head]:+.3f} (strongest head {top_head}: {effects[top_head]:+.3f})")

# %% [markdown]
# ## 4. Attribute: the prompt's attribution graph
#
# `attribute` freezes attention patterns and norms, replaces the MLPs by the transcoders and layer 2's
# attention by the Lorsa, and computes every direct edge between features, Lorsa heads, error, embedding, bias
# and logit nodes: each node's incoming edges sum to its value. `prune` keeps the nodes and edges that carry
# most of the influence on the logits; the page and the JSON open offline.

# %%
graph = attribute(rm, args.prompt, batch_size=64)
print(graph.summary())
print("largest |edge sum - value| relative to the value mass:", f"{float(graph.edge_sum_error('mass').max()):.1e}")
kept = prune(graph)
replacement, completeness = graph_scores(graph)
print(f"{int(kept.node_mask.sum())} nodes kept; replacement score {replacement:.2f}, completeness {completeness:.2f}")
graph_json = save_neuronpedia(graph, args.out / "graph.json", kept, tokenizer=tokenizer, scan="tinyshakespeare")
render_html(graph, kept, tokenizer=tokenizer, path=args.out / "graph.html")
print("graph:", args.out / "graph.html", "|", graph_json)

# %% [markdown]
# ## 5. Dashboard: what the head does across the corpus
#
# `collect_top_activations` streams corpus windows through the model with the Lorsa spliced in and keeps each
# head's top contexts; `ov_logit_lens` reads the tokens the head's output promotes; `write_dashboard` writes one
# self-contained HTML page (contexts with the z-pattern highlighted, the logit lens, the frequency).

# %%
text = default_corpus_path().read_text(encoding="utf-8")[-200_000:]
windows = TokenDataset.from_text(tokenizer, text, args.seq_len).tokens[:args.windows]
lorsa_only = ReplacementModel(model, lorsas=lorsas)
top = collect_top_activations(lorsa_only, 2, windows, n_top=8)
_, _, promoted = ov_logit_lens(lorsa_only, 2, [head], k=5, tokenizer=tokenizer)
print(f"head {head} fires on {float(top.frequency[head]):.1%} of the corpus tokens; it promotes {promoted[0]}")
dashboard = write_dashboard(args.out / f"head_{head}.html", head_dashboard_data(lorsa_only, 2, head, top, windows))
print("dashboard:", dashboard)
