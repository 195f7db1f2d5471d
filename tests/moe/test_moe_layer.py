"""MoELayer against a float64 loop-over-experts oracle and against transformers' MoE blocks."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from ringmoe.moe import MoELayer, load_balancing_loss, router_z_loss, update_correction_bias
from ringmoe.moe.dispatch import capacity_for, plan_dispatch

logging.getLogger("transformers").setLevel(logging.ERROR)


def _randomize(module, seed, std=0.3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return module


def oracle(layer: MoELayer, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Float64, one token and one expert at a time.  keep (T, k) bool drops assignments where False."""
    layer = copy.deepcopy(layer).double()
    flat = x.double().reshape(-1, layer.hidden_size)
    routing = layer.router(flat)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for slot in range(layer.top_k):
            if keep is not None and not keep[t, slot]:
                continue
            e = int(routing.topk_idx[t, slot])
            gate_up, down = layer.experts.gate_up[e], layer.experts.down[e]
            h = gate_up @ flat[t]
            gate, up = h[: down.shape[1]], h[down.shape[1] :]
            out[t] += routing.topk_weight[t, slot] * (down @ (F.silu(gate) * up))
    if layer.shared is not None:
        out += layer.shared(flat)
    return out.reshape(x.shape)


CONFIGS = [
    dict(router="softmax_topk", normalize_topk=True),
    dict(router="softmax_topk", normalize_topk=False, shared_ffn_size=24, shared_gated=True),
    dict(router="sigmoid_bias", normalize_topk=True, n_group=3, topk_group=2, routed_scaling_factor=2.5,
         shared_ffn_size=16),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[c["router"] + str(i) for i, c in enumerate(CONFIGS)])
def test_dropless_matches_float64_oracle_forward_and_backward(config):
    torch.manual_seed(0)
    layer = _randomize(MoELayer(32, 40, 6, 2, **config), seed=1)
    x = torch.randn(3, 13, 32, dtype=torch.float64, requires_grad=True)
    layer64 = copy.deepcopy(layer).double()
    y = layer64(x)
    want = oracle(layer64, x)
    assert torch.allclose(y, want, atol=1e-12, rtol=0)
    stats = layer64.last_stats
    assert int(stats.tokens_per_expert.sum()) == 39 * 2 and stats.dropped_assignments == 0
    # gradients: layer (vectorised) vs oracle (loops), both float64
    g = torch.randn_like(y)
    (y * g).sum().backward()
    grads = [p.grad.clone() for p in layer64.parameters()] + [x.grad.clone()]
    layer64.zero_grad()
    x.grad = None
    (oracle(layer64, x) * g).sum().backward()  # deepcopy inside: grads flow to x only
    assert torch.allclose(grads[-1], x.grad, atol=1e-10)
    ref_layer = copy.deepcopy(layer64)
    xr = x.detach().clone().requires_grad_()
    flat = xr.reshape(-1, 32)
    r = ref_layer.router(flat)
    out = torch.zeros_like(flat)
    for slot in range(2):
        for e in range(6):
            rows = (r.topk_idx[:, slot] == e).nonzero().flatten()
            out = out.index_add(0, rows, r.topk_weight[rows, slot, None] * ref_layer.experts.expert(e, flat[rows]))
    if ref_layer.shared is not None:
        out = out + ref_layer.shared(flat)
    (out.reshape(x.shape) * g).sum().backward()
    for (name, p), got in zip(ref_layer.named_parameters(), grads):
        assert torch.allclose(got, p.grad, atol=1e-10), name


def test_capacity_drops_exactly_the_lowest_weight_assignments():
    torch.manual_seed(3)
    layer = _randomize(MoELayer(16, 24, 4, 2, capacity_factor=0.5), seed=4)
    with torch.no_grad():  # skew the router so some experts overflow
        layer.router.weight[0] += 1.0
    x = torch.randn(40, 16, dtype=torch.float64)
    layer = layer.double()
    y = layer(x)
    routing = layer.router(x)
    capacity = capacity_for(0.5, 40, 2, 4)
    assert capacity == 10
    keep = torch.zeros(40, 2, dtype=torch.bool)
    for e in range(4):
        t, s = (routing.topk_idx == e).nonzero(as_tuple=True)
        best = torch.argsort(routing.topk_weight[t, s], descending=True, stable=True)[:capacity]
        keep[t[best], s[best]] = True
    stats = layer.last_stats
    assert stats.dropped_assignments == int((~keep).sum()) > 0
    assert stats.dropped_tokens == int((~keep.any(dim=1)).sum())
    assert torch.equal(stats.tokens_per_expert, torch.clamp(stats.routed_per_expert, max=capacity))
    assert torch.allclose(y, oracle(layer, x, keep), atol=1e-12)


def test_capacity_large_enough_equals_dropless():
    torch.manual_seed(5)
    layer = _randomize(MoELayer(16, 24, 4, 2), seed=6).double()
    x = torch.randn(30, 16, dtype=torch.float64)
    dropless = layer(x)
    layer.capacity_factor = 4.0  # capacity = 2 * T * k / E * ... >= every expert's load
    padded = layer(x)
    assert layer.last_stats.dropped_assignments == 0
    assert torch.allclose(dropless, padded, atol=1e-12)


def test_dropless_conserves_every_token_and_weight():
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 5, (50, 3), generator=gen)
    weight = torch.rand(50, 3, generator=gen, dtype=torch.float64)
    weight = weight / weight.sum(-1, keepdim=True)
    plan = plan_dispatch(idx, weight, 5, None)
    assert plan.order.numel() == 150 and torch.equal(plan.order.sort().values, torch.arange(150))
    assert torch.equal(plan.expert, idx.reshape(-1)[plan.order]) and bool((plan.expert.diff() >= 0).all())
    from ringmoe.moe.dispatch import unpermute

    combined = unpermute(torch.ones(150, 1, dtype=torch.float64), plan, weight, 50)
    assert torch.allclose(combined.squeeze(1), torch.ones(50, dtype=torch.float64))


def test_aux_loss_hand_checked():
    # 4 tokens, 2 experts, top-1: tokens 0-2 pick expert 0, token 3 expert 1
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    idx = torch.tensor([[0], [0], [0], [1]])
    # f = (3/4, 1/4), P = (0.65, 0.35): 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    assert torch.allclose(load_balancing_loss(probs, idx, 2), torch.tensor(1.15))
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    expect = (torch.log(torch.tensor(2.0)) ** 2 + torch.logsumexp(torch.tensor([1.0, -1.0]), 0) ** 2) / 2
    assert torch.allclose(router_z_loss(logits), expect)


def test_aux_loss_has_gradients_and_bias_update_balances():
    torch.manual_seed(8)
    layer = MoELayer(8, 8, 4, 1, router="sigmoid_bias")
    x = torch.randn(64, 8)
    layer(x)
    layer.last_stats.aux_loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    load = torch.tensor([10, 0, 3, 3])
    update_correction_bias(layer.router, load, rate=0.1)
    assert torch.allclose(layer.router.correction_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))


def test_group_limited_routing_of_an_empty_batch():
    """A rank with no tokens in a step (an ep group with no request) still routes its empty batch: (0, hidden)."""
    layer = MoELayer(8, 8, 6, 2, router="sigmoid_bias", n_group=3, topk_group=2)
    out = layer(torch.randn(0, 8))
    assert out.shape == (0, 8) and int(layer.last_stats.tokens_per_expert.sum()) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(8, 8, 4, 5)
    with pytest.raises(ValueError, match="router"):
        MoELayer(8, 8, 4, 2, router="hash")
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(8, 8, 4, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="n_group"):
        MoELayer(8, 8, 6, 2, router="sigmoid_bias", n_group=4)
    layer = MoELayer(8, 8, 4, 2)
    with pytest.raises(ValueError, match="hidden_size=8"):
        layer(torch.randn(3, 7))


def test_bfloat16_close_to_float64():
    torch.manual_seed(9)
    layer = _randomize(MoELayer(32, 48, 4, 2), seed=10, std=0.2)
    x = torch.randn(20, 32)
    want = oracle(layer, x)
    got = copy.deepcopy(layer).to(torch.bfloat16)(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() < 0.05 * want.abs().max()


# ---- transformers parity -------------------------------------------------------------
def _hf_block(kind):
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=32, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2)
        return MixtralSparseMoeBlock(cfg)
    if kind.startswith("qwen3"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=40, num_experts=8, num_experts_per_tok=3,
                             norm_topk_prob=kind.endswith("norm"))
        return Qwen3MoeSparseMoeBlock(cfg)
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    block = DeepseekV3MoE(cfg)
    return block


@pytest.mark.parametrize("kind", ["mixtral", "qwen3", "qwen3-norm", "deepseek_v3"])
def test_from_hf_matches_transformers_forward_and_backward(kind):
    torch.manual_seed(11)
    block = _randomize(_hf_block(kind), seed=12).double()
    if kind == "deepseek_v3":
        block.gate.e_score_correction_bias.copy_(torch.randn(8, dtype=torch.float64) * 0.1)
    layer = MoELayer.from_hf(block)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), block(xb)
    # transformers' routers compute in float32 even for float64 models (Mixtral/Qwen3 the
    # softmax, DeepSeek-V3 the gate itself), so agreement is at float32's resolution.
    tol = 1e-5
    assert torch.allclose(ya, yb, atol=tol, rtol=tol), (ya - yb).abs().max()
    g = torch.randn_like(ya)
    (ya * g).sum().backward()
    (yb * g).sum().backward()
    for ours, theirs in ((xa.grad, xb.grad), (layer.experts.gate_up.grad, block.experts.gate_up_proj.grad),
                         (layer.experts.down.grad, block.experts.down_proj.grad),
                         (layer.router.weight.grad, block.gate.weight.grad)):
        assert torch.allclose(ours, theirs, atol=100 * tol, rtol=100 * tol)


def test_from_hf_rejects_unknown_blocks():
    with pytest.raises(ValueError, match="from_hf supports"):
        MoELayer.from_hf(torch.nn.Linear(2, 2))


def test_sorted_experts_are_one_operator_of_a_compiled_graph():
    """From ``dense_below`` tokens on, ``forward_static`` runs the sorted per-expert GEMMs as the opaque
    ``ringmoe::grouped_experts`` operator: torch.compile traces the layer as one graph (fullgraph=True raises on a
    break) and computes the float64 oracle's output; a deep copy of the layer runs its own experts."""
    layer = _randomize(MoELayer(16, 24, 4, 2), seed=8).double().eval()
    x = torch.randn(layer.dense_below + 5, 16, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    with torch.no_grad():
        compiled = torch.compile(layer.forward_static, fullgraph=True, dynamic=True)(x)[0]
        torch.testing.assert_close(compiled, oracle(layer, x), rtol=0, atol=1e-10)
        twin = _randomize(copy.deepcopy(layer), seed=10)
        assert twin.op_key == layer.op_key  # carried over by the copy ...
        torch.testing.assert_close(twin.forward_static(x)[0], oracle(twin, x), rtol=0, atol=1e-10)
        assert twin.op_key != layer.op_key  # ... and replaced before the copy ran
        torch.testing.assert_close(layer.forward_static(x)[0], oracle(layer, x), rtol=0, atol=1e-10)
