"""Every entry point that runs the model on token ids it was given reads them against the model before it runs
(``envoy.nnsight_internals.check_token_ids``): an id outside the vocabulary, or a prompt / window longer than a learned
position table (GPT-2's ``wpe``), is an ``ArgumentError`` naming the call and the argument. Before, each was torch's
``IndexError: index out of range in self`` from inside an embedding — on CUDA a device-side assert, which ends the
process's CUDA context — after the replacement had been spliced in (the patching experiments, ``evaluate``,
``write_activation_cache``) or in the middle of training (``ActivationSource`` read a bad window when the trainer's
shuffled order reached it).

Generated: the entry point (parametrized), the family (GPT-2: learned positions, 128 rows; Llama: RoPE, no position
bound), the prompt form, the offending id and where it sits, the excess length. Each refusal is checked to name the
entry point and the argument; the bound itself (the last id, exactly 128 tokens) runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import make_lorsa, tiny_nnsight
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import ReplacementModel, TokenDataset, attribute, evaluate, get_adapter
from nnsight_lorsa.analysis import collect_top_activations, mhsa_correlation
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching import (
    MHSAHead,
    ablation_effect,
    activation_patching,
    head_swap,
    mean_activations,
    path_patching,
    random_ablation_control,
)
from nnsight_lorsa.training.activation_cache import write_activation_cache
from nnsight_lorsa.training.activations import ActivationSource

POSITIONS = 128  # tests/helpers.py's tiny GPT-2: n_positions
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.cache
def setup(family: str) -> tuple[Any, ReplacementModel, int]:
    """(nnsight model, replacement bundle with a Lorsa on layer 0, vocabulary size)."""
    model, hf = tiny_nnsight(family)
    replacement = ReplacementModel(model, lorsas={0: make_lorsa(hf, get_adapter(model), layer=0)})
    return model, replacement, hf.get_input_embeddings().num_embeddings


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 0]


def prompts_call(name: str, r: ReplacementModel) -> Callable[[Any], Any]:
    """The experiment ``name`` with its prompts (the argument under test) left open."""
    pool = [MHSAHead(0, 0), MHSAHead(0, 1)]
    return {
        "mean_activations": lambda p: mean_activations(r, pool[:1], p),
        "ablation_effect": lambda p: ablation_effect(r, p, pool[:1], metric=metric),
        "random_ablation_control": lambda p: random_ablation_control(r, p, pool, 1, n_samples=1, metric=metric),
        "activation_patching(clean)": lambda p: activation_patching(r, p, torch.ones(1, 4, dtype=torch.long),
                                                                    pool[:1], metric=metric),
        "activation_patching(corrupt)": lambda p: activation_patching(r, torch.ones(1, 4, dtype=torch.long), p,
                                                                      pool[:1], metric=metric),
        "path_patching(clean)": lambda p: path_patching(r, p, pool[:1], mode="zero", metric=metric),
        "path_patching(corrupt)": lambda p: path_patching(r, torch.ones(1, 4, dtype=torch.long), pool[:1],
                                                          corrupt=p, metric=metric),
        "head_swap": lambda p: head_swap(r, 0, 0, 1, p),
        "attribute": lambda p: attribute(r, p),
        "collect_top_activations": lambda p: collect_top_activations(r, 0, p),
        "mhsa_correlation": lambda p: mhsa_correlation(r, 0, p),
    }[name]


def dataset_call(name: str, r: ReplacementModel, tmp: Any) -> Callable[[TokenDataset], Any]:
    """The dataset consumer ``name`` with its dataset left open."""
    lorsas = r.lorsas
    return {
        "evaluate": lambda d: evaluate(lorsas, d, batch_size=2),
        "ActivationSource": lambda d: ActivationSource.attention(r.model, 0, d, batch_size=2),
        "write_activation_cache": lambda d: write_activation_cache(
            r.model, [ActivationSource.attention(r.model, 0, TokenDataset(torch.ones(1, 4, dtype=torch.long)),
                                                 1).x_sites[0]], d, tmp / "cache"),
    }[name]


PROMPT_CALLS = ["mean_activations", "ablation_effect", "random_ablation_control", "activation_patching(clean)",
                "activation_patching(corrupt)", "path_patching(clean)", "path_patching(corrupt)", "head_swap",
                "attribute", "collect_top_activations", "mhsa_correlation"]
#: what each takes: the experiments any form nnsight batches; attribute one sequence; the analyses a 2-D tensor
ONE_PROMPT = {"attribute"}
TENSOR_ONLY = {"collect_top_activations", "mhsa_correlation"}


def in_form(ids: torch.Tensor, form: str) -> Any:
    """``ids`` ``(batch, pos)`` in one of the forms nnsight batches."""
    return {"2-D tensor": ids, "list of id lists": ids.tolist(), "list of 1-D tensors": list(ids),
            "mapping with input_ids": {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            "1-D tensor": ids[0], "list of ints": ids[0].tolist()}[form]


def forms_of(name: str) -> list[str]:
    if name in ONE_PROMPT:
        return ["1-D tensor", "list of ints"]
    if name in TENSOR_ONLY:
        return ["2-D tensor"]
    return ["2-D tensor", "list of id lists", "list of 1-D tensors", "mapping with input_ids", "1-D tensor",
            "list of ints"]


def argument(name: str) -> str:
    """The argument an error names: the experiment's prompts, or the analyses' tokens."""
    if "(" in name:
        return name.replace("(", ": ").rstrip(")")
    return {"attribute": "a prompt", "collect_top_activations": "tokens", "mhsa_correlation": "tokens"}.get(
        name, f"{name}: prompts")


ONE_ROW_FORMS = ("1-D tensor", "list of ints")


@st.composite
def bad_ids(draw: Any, family: str, one_row: bool, negative: bool = True) -> tuple[torch.Tensor, str]:
    """``(batch, pos)`` ids with one fault: an id outside the vocabulary (past it or, with ``negative``, below 0) at a
    drawn place, or (GPT-2) one position too many or more."""
    _, _, vocab = setup(family)
    faults = ["id past the vocabulary"] + (["negative id"] if negative else []) + (
        ["too long"] if family == "gpt2" else [])
    fault = draw(st.sampled_from(faults))
    batch = 1 if one_row else draw(st.integers(1, 3))
    length = POSITIONS + draw(st.integers(1, 40)) if fault == "too long" else draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**16))
    ids = torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    if fault != "too long":
        row, col = draw(st.integers(0, batch - 1)), draw(st.integers(0, length - 1))
        ids[row, col] = vocab + draw(st.integers(0, 10**6)) if fault == "id past the vocabulary" else \
            -draw(st.integers(1, 10**6))
    return ids, fault


def expected(fault: str, vocab: int) -> str:
    return (rf"must be at most {POSITIONS} tokens long \(the model's learned position embeddings"
            if fault == "too long" else rf"must be token ids in \[0, {vocab}\) \(the model's vocabulary\)")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", PROMPT_CALLS)
def test_prompts_outside_the_model_are_refused_by_name_before_it_runs(family, name):
    _, r, vocab = setup(family)
    call = prompts_call(name, r)
    forms = forms_of(name)

    @SETTINGS
    @given(data=st.data())
    def check(data):
        form = data.draw(st.sampled_from(forms))
        ids, fault = data.draw(bad_ids(family, one_row=form in ONE_ROW_FORMS))
        with pytest.raises(ArgumentError, match=rf"{argument(name)} {expected(fault, vocab)}"):
            call(in_form(ids, form))

    check()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", ["evaluate", "ActivationSource", "write_activation_cache"])
def test_datasets_outside_the_model_are_refused_by_name_before_it_runs(family, name, tmp_path):
    _, r, vocab = setup(family)
    call = dataset_call(name, r, tmp_path)

    @SETTINGS
    @given(case=bad_ids(family, one_row=False, negative=False))  # TokenDataset itself refuses a negative id
    def check(case):
        ids, fault = case
        with pytest.raises(ArgumentError, match=rf"{name}: the dataset's windows {expected(fault, vocab)}"):
            call(TokenDataset(ids))
        assert not (tmp_path / "cache").exists()

    check()


def test_the_bounds_themselves_run():
    """The last id of the vocabulary, and exactly as many tokens as the position table has rows, run (the check is
    not one off), and text is measured in the model's tokens."""
    model, r, vocab = setup("gpt2")
    ids = torch.randint(1, vocab, (2, POSITIONS), generator=torch.Generator().manual_seed(0))
    ids[1, 7] = vocab - 1
    mean_activations(r, [MHSAHead(0, 0)], ids)
    evaluate(r.lorsas, TokenDataset(ids), batch_size=2)
    ActivationSource.attention(model, 0, TokenDataset(ids), batch_size=2)
    words = " ".join(f"w{i % 20 + 2}" for i in range(POSITIONS))
    assert len(model.tokenizer(words)["input_ids"]) == POSITIONS
    ablation_effect(r, words, [MHSAHead(0, 0)], metric=metric)
    with pytest.raises(ArgumentError, match=rf"ablation_effect: prompts {expected('too long', vocab)}"):
        ablation_effect(r, [words + " w3", "w2"], [MHSAHead(0, 0)], metric=metric)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", ["circuit_size", "component_scores", "component_scores(method='patching')"])
def test_a_task_built_with_another_tokenizer_is_refused_by_name_before_it_runs(family, name):
    """A task built with another model's tokenizer (the embedded model's 1024 ids against the tiny models' 128) held
    ids past the model's vocabulary: torch's ``IndexError`` inside ``circuit_size`` / ``component_scores``' first trace.
    Each of the task builders, drawn."""
    from nnsight_lorsa.assets import default_model_dir
    from nnsight_lorsa.envoy import load_tokenizer
    from nnsight_lorsa.patching import greater_than_task, induction_task, ioi_task
    from nnsight_lorsa.patching.circuit import circuit_size, component_scores

    _, r, vocab = setup(family)
    words = load_tokenizer(default_model_dir())
    comps = [MHSAHead(0, 0), MHSAHead(0, 1)]
    call = {"circuit_size": lambda t: circuit_size(r, t, comps),
            "component_scores": lambda t: component_scores(r, t, comps),
            "component_scores(method='patching')": lambda t: component_scores(r, t, comps, method="patching")}[name]

    @SETTINGS
    @given(build=st.sampled_from([lambda s: induction_task(words, n_prompts=3, seq_len=6, seed=s),
                                  lambda s: ioi_task(words, n_prompts=3, seed=s),
                                  lambda s: greater_than_task(words, n_prompts=3, seed=s)]),
           seed=st.integers(0, 2**16))
    def check(build, seed):
        task = build(seed)
        if int(torch.cat([task.clean, task.corrupt]).max()) < vocab:
            return  # every id of this draw is also one of the tiny model's
        refused.append(seed)
        where = name.split("(")[0]
        with pytest.raises(ArgumentError, match=rf"{where}: task\.(clean|corrupt) {expected('id', vocab)}"):
            call(task)

    refused: list[int] = []
    check()
    assert refused  # the draws reached the check (the embedded tokenizer's names and numbers are past id 128)
