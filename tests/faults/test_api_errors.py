"""Bad input to the library raises a clear ValueError/TypeError naming the argument, before any communication."""

from __future__ import annotations

import pytest
import torch

from ringmoe import flash_attn_func
from ringmoe.model import MoETransformer, preset
from ringmoe.serve import generate
from ringmoe.moe import MoELayer
from ringmoe.parallel import ring_flash_attn_func
from ringmoe.parallel.launch import spawn


def test_zero_query_heads_is_a_value_error():
    q = torch.randn(1, 8, 0, 16)
    k = torch.randn(1, 8, 2, 16)
    for backend in ("native", "blockwise", "reference"):
        with pytest.raises(ValueError, match="q must have at least one head"):
            flash_attn_func(q, k, k, backend=backend)


@pytest.mark.parametrize("capacity", [float("inf"), float("nan"), 0.0, -1.0, True])
def test_capacity_factor_must_be_finite_and_positive(capacity):
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(16, 32, 4, 2, capacity_factor=capacity)
    with pytest.raises(ValueError, match="capacity_factor"):
        preset("tiny").replace(capacity_factor=capacity)


@pytest.mark.parametrize("top_k", [2.0, True, "2"])
def test_top_k_must_be_an_int(top_k):
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(16, 32, 4, top_k)


def test_input_dtype_must_match_the_expert_weights():
    layer = MoELayer(16, 32, 4, 2)
    with pytest.raises(TypeError, match=r"x is torch.float64 but the layer's weights are torch.float32"):
        layer(torch.randn(5, 16, dtype=torch.float64))


def test_empty_prompt_is_a_value_error():
    model = MoETransformer(preset("tiny"))
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, torch.zeros(1, 0, dtype=torch.int64), 2)


def test_reference_backend_without_keys_gives_zero_output_and_finite_gradients():
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 0, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 0, 2, 8, dtype=torch.float64, requires_grad=True)
    for backend in ("reference", "blockwise"):
        out, lse = flash_attn_func(q, k, v, backend=backend, return_lse=True)
        assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()
        (grad,) = torch.autograd.grad(out.sum(), q)
        assert torch.equal(grad, torch.zeros_like(grad))


def _ring_with_uneven_shards(rank, world):
    local = 6 if rank == 1 else 4  # rank 1 holds more tokens than the others
    q = torch.randn(1, local, 2, 8)
    try:
        ring_flash_attn_func(q, q, q, causal=True, layout="contiguous")
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_ring_shards_of_different_lengths_raise_on_every_rank(world):
    messages = spawn(_ring_with_uneven_shards, world, timeout=60)
    for message in messages:
        assert message is not None and "same shape" in message and "rank 1: q (1, 6, 2, 8)" in message


def test_generate_stops_rows_at_end_of_sequence():
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny"))
    model.init_weights(3)
    prompt = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    free = generate(model, prompt, 8).tokens
    eos = int(free[0, 2])  # row 0 meets this token at step 2
    stopped = generate(model, prompt, 8, eos_token_id=eos).tokens
    first = {row: next((i for i, t in enumerate(free[row].tolist()) if t == eos), None) for row in (0, 1)}
    for row, hit in first.items():
        if hit is None:
            assert torch.equal(stopped[row], free[row, :stopped.shape[1]])
        else:  # the same tokens up to EOS, then padding with the EOS id
            assert torch.equal(stopped[row, :hit + 1], free[row, :hit + 1])
            assert (stopped[row, hit:] == eos).all()
    # both rows ending at their first token stops decoding at once
    both = generate(model, prompt, 8, eos_token_id=[int(free[0, 0]), int(free[1, 0])]).tokens
    assert both.shape == (2, 1)
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, prompt, 2, eos_token_id=10_000)
