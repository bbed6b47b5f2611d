"""``init_dictionary_`` (every SAE, transcoder and CLT init) allocates nothing on the host for a module on ``meta``
(it drew the whole fp32 decoder on the CPU and copied it to ``meta``: tens of GB for a Llama-3.1-8B CLT), draws a
decoder on the CPU in runs of at most :data:`INIT_CHUNK_ELEMENTS` elements, and gives the same bits as the one-draw
init it replaced, seeded or from the default generator, in every dtype."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from nnsight_lorsa.modules import sparse_coder
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.sparse_coder import init_dictionary_
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig


class HostSpy(TorchDispatchMode):
    """Refuses (before it runs) any op that would make or read a non-``meta`` tensor of more than ``limit`` elements:
    a factory (``randn``, ``empty``, …) whose ``size`` is larger and whose device is not ``meta``, or any op with such
    a tensor argument. ``largest``: the largest non-``meta`` tensor seen."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.largest = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        size = args[0] if args and isinstance(args[0], (list, tuple)) else None
        if size is not None and all(isinstance(n, int) for n in size) and (device is None or
                                                                           torch.device(device).type != "meta"):
            self._see(math.prod(size), func)
        for a in [*args, *kwargs.values()]:
            if isinstance(a, torch.Tensor) and not a.is_meta:
                self._see(a.numel(), func)
        return func(*args, **kwargs)

    def _see(self, n: int, func) -> None:
        self.largest = max(self.largest, n)
        if n > self.limit:
            raise AssertionError(f"{func} on {n} host elements")


#: Llama-3.1-8B's CLT: 32 layers, d_model 4096, 32768 features (decoder of layer 0: 4.3 G elements)
CLT_8B = CLTConfig(d_in=4096, d_sae=32768, n_layers=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_clt_on_meta_at_the_8b_shape_allocates_nothing_on_the_host(dtype):
    with HostSpy(limit=4096) as spy:
        clt = CrossLayerTranscoder(CLT_8B, device="meta", dtype=dtype)
    assert clt.W_dec(0).is_meta and clt.W_dec(0).shape == (32768, 32, 4096)
    assert spy.largest <= 4096


@pytest.mark.parametrize("make", [
    lambda: SparseAutoencoder(SAEConfig(d_in=4096, d_sae=131072, hook="model.layers.3"), device="meta"),
    lambda: Transcoder(TranscoderConfig(d_in=4096, d_sae=131072, d_out=2048, layer=3), device="meta")],
    ids=["sae", "transcoder"])
def test_an_sae_or_transcoder_on_meta_allocates_nothing_on_the_host(make):
    with HostSpy(limit=4096):
        module = make()
    assert module.W_dec.is_meta and module.W_enc.is_meta


def _old_init(W_enc: torch.Tensor, W_dec: torch.Tensor, generator: torch.Generator | None) -> None:
    """The init before 2026-11-27 (one fp32 draw of the whole decoder on the generator's device or the CPU)."""
    d_sae, d_out = W_dec.shape
    W_dec.copy_(torch.randn(d_sae, d_out, generator=generator, dtype=torch.float32).to(W_dec))
    W_dec.div_(W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    if W_enc.shape == W_dec.T.shape:
        W_enc.copy_(W_dec.T)
    else:
        draw = torch.randn(*W_enc.shape, generator=generator, dtype=torch.float32,
                           device=generator.device if generator is not None else "cpu")
        W_enc.copy_((draw / draw.norm(dim=0, keepdim=True).clamp_min(1e-12)).to(W_enc))


@settings(max_examples=40, deadline=None)
@given(d_sae=st.integers(1, 90), d_out=st.integers(1, 40), d_in=st.sampled_from([None, 1, 7, 33]),
       chunk=st.sampled_from([1, 16, 40, 100, 2**24]), seeded=st.booleans(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_the_runs_draw_the_same_bits_as_one_draw(d_sae, d_out, d_in, chunk, seeded, seed, dtype):
    """Runs of rows (forced short by a small :data:`INIT_CHUNK_ELEMENTS`) give the one-draw init's bits, and leave
    the generator where it left it."""
    d_in = d_out if d_in is None else d_in
    got = (torch.empty(d_in, d_sae, dtype=dtype), torch.empty(d_sae, d_out, dtype=dtype))
    want = (torch.empty(d_in, d_sae, dtype=dtype), torch.empty(d_sae, d_out, dtype=dtype))
    saved = sparse_coder.INIT_CHUNK_ELEMENTS
    sparse_coder.INIT_CHUNK_ELEMENTS = chunk
    try:
        gens = []
        for target, init in ((got, init_dictionary_), (want, _old_init)):
            g = torch.Generator().manual_seed(seed) if seeded else None
            if g is None:
                torch.manual_seed(seed)
            init(*target, g)
            gens.append(torch.randn(3, generator=g))
    finally:
        sparse_coder.INIT_CHUNK_ELEMENTS = saved
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(gens[0], gens[1])


def test_a_large_decoder_is_drawn_in_runs_of_rows():
    """A 2**25-element decoder (128 MiB fp32): no host tensor above one run's 2**24 elements but the decoder itself
    and its encoder (one tied copy: ``W_enc = W_decᵀ``)."""
    W_dec = torch.empty(2**15, 2**10)
    W_enc = torch.empty(2**10, 2**15)
    with HostSpy(limit=2**25) as spy:
        init_dictionary_(W_enc, W_dec, torch.Generator().manual_seed(0))
    assert spy.largest == 2**25
    with HostSpy(limit=2**24), pytest.raises(AssertionError, match="host elements"):
        init_dictionary_(W_enc, W_dec, torch.Generator().manual_seed(0))  # the decoder itself is read (the norm)
    drawn = []

    class Draws(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten.randn:
                drawn.append(out.numel())
            return out

    with Draws():
        init_dictionary_(W_enc, W_dec, torch.Generator().manual_seed(0))
    assert drawn == [2**24, 2**24]
