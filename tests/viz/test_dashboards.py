"""Head dashboards rendered in headless Chromium (DOM after scripts ran) and the matplotlib figures."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import render_dom, require_chromium, screenshot

from nnsight_lorsa import LorsaSet, ReplacementModel
from nnsight_lorsa.analysis import qk_feature_impacts
from nnsight_lorsa.analysis.heads import collect_top_activations, mhsa_correlation, ov_feature_cosines
from nnsight_lorsa.assets import default_corpus_path, default_lorsa_dir
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import TokenDataset
from nnsight_lorsa.viz.dashboard import head_dashboard_data, render_dashboard, write_dashboard
from nnsight_lorsa.viz.figures import plot_heads_spanned, plot_operand_grid, plot_z_pattern


@pytest.fixture(scope="module")
def dashboard_data():
    model = load_model()
    ls = LorsaSet.from_pretrained(model, default_lorsa_dir())
    rm = ReplacementModel(model, lorsas=ls)
    text = default_corpus_path().read_text(encoding="utf-8")[:20000]
    tokens = TokenDataset.from_text(model.tokenizer, text, 48).tokens[:12]
    top = collect_top_activations(rm, 2, tokens, n_top=4)
    corr = mhsa_correlation(rm, 2, tokens)
    head = top.top_heads(1)[0]
    torch.manual_seed(0)  # an untrained SAE on the Lorsa input: the App. F sections only need features
    sae = SparseAutoencoder(SAEConfig(d_in=128, d_sae=64, activation="topk", activation_params={"k": 8}))
    qk = qk_feature_impacts(rm, 2, head, sae, tokens[:4], batch_size=2)
    ov = ov_feature_cosines(ls[2], head, sae_in_decoder=sae.W_dec, sae_out_encoder=sae.W_enc.T, k=3)
    return head_dashboard_data(rm, 2, head, top, tokens, n_contexts=4, correlation=corr,
                               extra={"note": "a <b>test</b> & </script>"}, qk_features=qk, ov_features=ov,
                               n_features=3)


def test_dashboard_renders_in_chromium(dashboard_data, tmp_path):
    require_chromium()
    d = dashboard_data
    path = write_dashboard(tmp_path / "head.html", d)
    raw = path.read_text()
    assert "<div id='app'></div>" in raw                        # the content comes from the script ...
    dom = render_dom(path)
    assert 'data-rendered="yes"' in dom                          # ... which ran
    assert f"<h1>Lorsa L2.H{d['head']}</h1>" in dom
    assert len(re.findall(r'class="ctx"', dom)) == len(d["contexts"]) > 0
    assert dom.count('class="tok query"') == len(d["contexts"])
    assert len(re.findall(r"<tr>", dom)) == len(d["logit_lens"]) + len(d.get("mhsa", []))
    aspects = [r["aspect"] for r in d["sae_features"]]           # the four aspects of App. F
    assert set(aspects) == {"Q", "K", "V", "O"} and aspects.count("V") == aspects.count("O") == 3
    for aspect in "QKVO":
        assert len(re.findall(rf'<tr class="aspect-{aspect}">', dom)) == aspects.count(aspect)
    assert "a &lt;b&gt;test&lt;/b&gt; &amp; &lt;/script&gt;" in dom   # escaped, did not break the page
    assert f"{100 * d['frequency']:.2f}% of" in dom
    png = screenshot(path, tmp_path / "head.png", size=(1000, 700))
    assert png.stat().st_size > 5000


def test_dashboard_refuses_another_heads_qk_features(dashboard_data):
    model = load_model()
    ls = LorsaSet.from_pretrained(model, default_lorsa_dir())
    rm = ReplacementModel(model, lorsas=ls)
    tokens = TokenDataset.from_text(model.tokenizer, default_corpus_path().read_text(encoding="utf-8")[:4000],
                                    48).tokens[:2]
    top = collect_top_activations(rm, 2, tokens, n_top=2)
    head = dashboard_data["head"]
    sae = SparseAutoencoder(SAEConfig(d_in=128, d_sae=16, activation="topk", activation_params={"k": 2}))
    other = qk_feature_impacts(rm, 2, (head + 1) % ls[2].cfg.n_ov_heads, sae, tokens, batch_size=2)
    with pytest.raises(ConfigMismatchError, match="qk_features"):
        head_dashboard_data(rm, 2, head, top, tokens, qk_features=other)


def test_render_is_self_contained(dashboard_data):
    page = render_dashboard(dashboard_data)
    assert "http://" not in page and "https://" not in page and "src=" not in page


def test_figures(tmp_path):
    zp = torch.randn(6, 6).tril()
    out = [plot_z_pattern(zp, list("abcdef"), tmp_path / "zp.png"),
           plot_operand_grid(torch.rand(10, 10), tmp_path / "op.png", operands=range(10)),
           plot_heads_spanned(torch.tensor([0, 1, 1, 2, 3, 1]), tmp_path / "hist.png")]
    for p in out:
        assert p.exists() and p.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("hostile", ["<!--<script>", "</script><script>alert(1)</script>", "]]>&amp;<\u2028"])
def test_hostile_strings_and_non_finite_numbers_still_render(dashboard_data, hostile, tmp_path):
    """A ``<!--<script>`` in the title or an ``extra=`` field and a NaN / inf number gave a blank page
    (only ``</`` was escaped; NaN is not JSON): now the strings show as text and the numbers as "n/a"."""
    import copy

    d = copy.deepcopy(dashboard_data)
    d["title"] = f"head {hostile}"
    d["extra"] = {"note": hostile}
    d["frequency"] = float("nan")
    d["contexts"][0]["z"] = float("inf")
    d["logit_lens"][0]["logit"] = float("-inf")
    page = render_dashboard(d)
    data = page.split("id='head-data'>", 1)[1].split("</script>", 1)[0]
    assert "<" not in data and "NaN" not in data and "Infinity" not in data  # inert, valid JSON
    require_chromium()
    path = write_dashboard(tmp_path / "hostile.html", d)
    dom = render_dom(path)
    assert 'data-rendered="yes"' in dom
    assert "active on n/a% of" in dom and "z=n/a" in dom
    assert len(re.findall(r'class="ctx"', dom)) == len(d["contexts"])
