"""``nnsight_lorsa.envoy.load_model``: offline by argument (``local_files_only=True`` reaches every
``from_pretrained``), no process-wide side effect (``os.environ`` unchanged), and the same model as
nnsight's plain ``TransformersModel(path, ...)`` load (bit-identical logits)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

import nnsight_lorsa.demo
from nnsight_lorsa.assets import default_model_dir
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.nnsight_internals import hf_module
from nnsight_lorsa.envoy.tokens import load_tokenizer


def test_demo_reexports_the_loader():
    assert nnsight_lorsa.demo.load_model is load_model


def test_loading_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    model = load_model()
    assert dict(os.environ) == before
    assert "HF_HUB_OFFLINE" not in os.environ
    assert model.tokenizer is not None


def test_every_load_is_local_files_only(monkeypatch):
    seen: list[tuple[str, object]] = []

    def spy(what, cls, original):
        def load(klass, *args, **kwargs):
            seen.append((what, kwargs.get("local_files_only")))
            return original.__func__(klass, *args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", classmethod(load))

    spy("tokenizer", AutoTokenizer, AutoTokenizer.from_pretrained)
    spy("config", AutoConfig, AutoConfig.from_pretrained)
    spy("weights", PreTrainedModel, PreTrainedModel.from_pretrained)
    load_model()
    assert {what for what, _ in seen} == {"tokenizer", "config", "weights"}, seen
    assert all(flag is True for _, flag in seen), seen


def test_same_model_as_nnsights_plain_load():
    from nnsight import TransformersModel

    path = str(default_model_dir())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = TransformersModel(path, task="text-generation", tokenizer=load_tokenizer(path), dispatch=True,
                                  dtype=torch.float32, device="cpu")
    ours = load_model()
    a, b = hf_module(plain), hf_module(ours)
    assert type(a) is type(b) and a.config.to_dict() == b.config.to_dict()
    assert a.training == b.training
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    ids = torch.tensor([[1, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_dtype_passes_through(dtype):
    model = load_model(dtype=dtype)
    assert next(hf_module(model).parameters()).dtype == dtype
