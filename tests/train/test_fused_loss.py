"""The fused LM-head cross entropy equals F.cross_entropy of the materialised logits, value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringmoe.train.data import IGNORE
from ringmoe.train.fused_loss import linear_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_cross_entropy_float64(chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(67, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(53, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 53, (67,), generator=gen)
    labels[torch.randperm(67, generator=gen)[:9]] = IGNORE
    scale = torch.rand((), generator=gen, dtype=torch.float64) + 0.5
    fused = linear_cross_entropy(hidden, weight, labels, chunk=chunk)
    (fused * scale).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = F.cross_entropy(hidden @ weight.t(), labels, ignore_index=IGNORE, reduction="sum")
    (want * scale).backward()
    assert fused.dtype == torch.float64
    torch.testing.assert_close(fused, want, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-12, atol=1e-12)


def test_bf16_autocast_error_within_twice_plain_pytorch():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 32, generator=gen)
    weight = torch.randn(70, 32, generator=gen) * 0.3
    labels = torch.randint(0, 70, (40,), generator=gen)
    exact = F.cross_entropy(hidden.double() @ weight.double().t(), labels, reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(hidden, weight, labels, chunk=16)
        plain = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="sum")
    assert fused.dtype == torch.float32
    assert abs(float(fused) - float(exact)) <= 2 * abs(float(plain) - float(exact)) + 1e-6


def test_rows_without_targets_give_zero_and_bad_shapes_are_refused():
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((5,), IGNORE))
    loss.backward()
    assert float(loss.detach()) == 0.0 and not hidden.grad.any() and not weight.grad.any()
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, torch.randn(6, 5), torch.zeros(5, dtype=torch.int64))
