"""Multi-head latent attention: the absorbed form (attention in the latent space, what the engine's latent
cache runs) equals the expanded form at float64, and the cache holds only latents and RoPE keys."""

from __future__ import annotations

import pytest
import torch

from ringmoe import flash_attn_func
from ringmoe.model import MoETransformer, preset
from ringmoe.model.rope import rope_tables
from ringmoe.serve import Engine


class _Flash:
    """A backend that checks what it is handed: expanded heads, or (absorbed) one latent "K/V head"."""

    latent_ring = False

    def __init__(self, absorbed: bool):
        self.absorbed = absorbed

    def attend(self, index, q, k, v):
        if self.absorbed:
            assert k.shape[2] == 1 and k.shape[-1] == 32 + 8  # one latent "head": rank + rope
        return flash_attn_func(q, k, v, causal=True, backend="blockwise")


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_absorbed_equals_expanded_float64(q_lora_rank):
    config = preset("deepseek-v3-tiny").replace(q_lora_rank=q_lora_rank)
    model = MoETransformer(config).double()
    model.init_weights(2, std=0.2)
    attention = model.layers[1].self_attn
    x = torch.randn(2, 13, config.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cos, sin = rope_tables(torch.arange(13), config.qk_rope_head_dim, config.rope_theta, torch.float64)
    want = attention(x, cos, sin, _Flash(absorbed=False), 1)
    got = attention(x, cos, sin, _Flash(absorbed=True), 1)
    assert (got - want).abs().max() < 1e-10


def test_the_engine_caches_latents_only():
    config = preset("deepseek-v3-tiny")
    engine = Engine(MoETransformer(config), kv_cache_tokens=64)
    latent = config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    expanded = config.num_layers * 2 * config.num_heads * config.head_dim * 4
    assert engine.runner.bytes_per_token == latent and expanded / latent == 2 * 4 * 24 / 40
    assert engine.runner.k_cache[0].shape[2:] == (1, 40) and engine.runner.v_cache is engine.runner.k_cache
