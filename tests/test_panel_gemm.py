"""``ringmoe.panel_gemm``: the grouped product of few rows by panel-packed weight stacks, against float64."""

from __future__ import annotations

import subprocess
from copy import deepcopy

import pytest
import torch

from ringmoe import panel_gemm
from ringmoe.model import MoETransformer, preset
from ringmoe.moe.layer import DENSE_BELOW
from ringmoe.serve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not panel_gemm.available(), reason="panel_gemm runs on x86-64 with AVX2 and a compiler")


def _reference(x: torch.Tensor, counts: list[int], w: torch.Tensor) -> torch.Tensor:
    """float64 rows of each group times its matrix's transpose: (R, N)."""
    parts = x.double().split(counts)
    return torch.cat([part @ w[g].double().T for g, part in enumerate(parts)]) if parts else x.new_zeros(0)


@pytest.mark.parametrize("seed, groups, n, k", [(1, 3, 50, 37), (2, 1, 16, 64), (3, 5, 7, 3), (4, 4, 33, 130),
                                                 (5, 2, 1, 1), (6, 8, 64, 300), (7, 2, 17, 65)])
def test_grouped_products_match_float64_within_torchs_own_error(seed, groups, n, k):
    """Odd widths (edge panels of 1..15 columns), sums over k shorter and longer than a block, groups of 0..13 rows
    (every row kernel and several blocks of rows): the error vs float64 is at most twice torch's float32 error."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(groups, n, k, generator=gen)
    counts = torch.randint(0, 14, (groups,), generator=gen).tolist()
    counts[0] = 0 if groups > 1 else 11  # a group without rows
    counts[-1] = counts[-1] or 4
    x = torch.randn(sum(counts), k, generator=gen)
    got = panel_gemm.grouped_linear(x, counts, panel_gemm.pack(w), n)
    ref = _reference(x, counts, w)
    plain = torch.cat([part @ w[g].T for g, part in enumerate(x.split(counts))])
    assert got.shape == (sum(counts), n) and got.dtype == torch.float32
    plain_error = (plain.double() - ref).abs().max().item()
    assert (got.double() - ref).abs().max().item() <= 2 * plain_error + 1e-6 * ref.abs().max().item()


def test_a_long_sum_is_as_accurate_as_torchs():
    """K = 2048: the sum over k runs in blocks, so its error stays within torch's (a plain running sum was 3-5x)."""
    torch.manual_seed(0)
    w, x = torch.randn(2, 40, 2048), torch.randn(12, 2048)
    got = panel_gemm.grouped_linear(x, [5, 7], panel_gemm.pack(w), 40)
    ref = _reference(x, [5, 7], w)
    plain = torch.cat([x[:5] @ w[0].T, x[5:] @ w[1].T])
    assert (got.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max()


def test_each_row_gets_the_same_bits_whatever_rows_are_beside_it_and_whatever_the_threads():
    """Batch invariance: a row alone, or among 1..13 others of its group, or under 1 or 2 threads, same bits."""
    torch.manual_seed(3)
    w = torch.randn(2, 70, 96)
    packed = panel_gemm.pack(w)
    x = torch.randn(13, 96)
    alone = torch.cat([panel_gemm.grouped_linear(x[i:i + 1], [0, 1], packed, 70) for i in range(13)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 6, 7, 13):
                together = panel_gemm.grouped_linear(x[:rows], [0, rows], packed, 70)
                assert torch.equal(together, alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_pack_keeps_the_weights_bytes_and_refuses_what_it_cannot_pack():
    w = torch.randn(3, 21, 10)
    assert panel_gemm.pack(w).shape == (3, 210)
    assert panel_gemm.pack(w[0]).shape == (1, 210)  # a matrix: one group
    assert sorted(panel_gemm.pack(w).flatten().tolist()) == sorted(w.flatten().tolist())  # the same values, moved
    with pytest.raises(TypeError, match="float32"):
        panel_gemm.pack(w.double())
    packed = panel_gemm.pack(w)
    with pytest.raises(ValueError, match="counts of 2 groups"):
        panel_gemm.grouped_linear(torch.randn(4, 10), [2, 2], packed, 21)
    with pytest.raises(ValueError, match=r"not of \(20, 10\)"):
        panel_gemm.grouped_linear(torch.randn(4, 10), [1, 1, 2], packed, 20)
    assert panel_gemm.grouped_linear(torch.randn(0, 10), [0, 0, 0], packed, 21).shape == (0, 21)


def test_the_build_is_cached_by_source_and_a_failed_build_raises(tmp_path, monkeypatch):
    """A fresh cache folder gets one library (renamed from a staging folder, which is gone); a second call loads
    the same file without compiling; a source that does not compile raises (the caller then keeps torch's
    products)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = panel_gemm._SOURCE.read_bytes()
    compiler = "cc" if subprocess.run(["which", "cc"], capture_output=True).returncode == 0 else "gcc"
    first = panel_gemm._build(source, compiler)
    assert first.parent == tmp_path / "ringmoe" / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert panel_gemm._build(source, compiler) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging folder left
    with pytest.raises(subprocess.CalledProcessError):
        panel_gemm._build(source + b"\nthis is not C;\n", compiler)
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_a_prepacked_engine_runs_the_sorted_products_where_every_expert_on_every_token_ran():
    """With panel copies the fixed-shape step skips the dense form (``MoELayer.fit_static_forms``); without them the
    dense form keeps its range; both engines give the same greedy tokens while the batch shrinks from 36 rows
    (sorted products) through the dense range to the per-assignment products (requests end one by one)."""
    torch.manual_seed(0)
    base = MoETransformer(preset("tiny")).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, base.config.vocab_size, (5,), generator=gen).tolist() for _ in range(36)]
    params = [SamplingParams(temperature=0, max_tokens=1 + i, ignore_eos=True) for i in range(36)]
    tokens = {}
    for prepack in (True, False):
        model = deepcopy(base)  # a copy has no packs of its own (the table is keyed by tensor)
        engine = Engine(model, prepack_weights=prepack, decode_graph="static", max_num_seqs=40)
        for _, layer in model.moe_layers():
            assert layer.mlp.experts.grouped_kernel_ready() is prepack
            assert layer.mlp.dense_below == (layer.mlp.static_form_edges()[0] if prepack else DENSE_BELOW)
        tokens[prepack] = [out.output_ids for out in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False] and [len(ids) for ids in tokens[True]] == list(range(1, 37))
