"""Batch-invariant building blocks: a row's result does not depend on how many rows share the call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringmoe.batch_invariant import batch_invariant, linear, rowwise


def test_linear_and_rowwise_activations_do_not_depend_on_the_row_count():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    x = torch.randn(37, 32, generator=gen)
    with batch_invariant(16):
        for rows in (1, 5, 16, 17, 37):
            assert torch.equal(linear(x[:rows], weight)[0], linear(x[:1], weight)[0])
            h = linear(x[:rows], weight)
            for fn in (F.silu, torch.sigmoid):
                assert torch.equal(rowwise(fn, h)[:1], rowwise(fn, h[:1]))
                assert torch.equal(rowwise(fn, h), fn(h).to(h.dtype)) or (rowwise(fn, h) - fn(h)).abs().max() < 1e-6
    assert torch.equal(rowwise(F.silu, x), F.silu(x))  # outside the block: the plain function
