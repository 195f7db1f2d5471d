"""Model configuration, presets and input checks of the single-device MoE transformer."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import ModelConfig, MoETransformer, preset
from ringmoe.serve import generate
from ringmoe.model.rope import apply_rope, attention_factor, inv_freq, rope_tables


def test_presets_have_the_published_parameter_counts():
    mixtral = preset("mixtral-8x7b")  # 46.7B total, 12.9B active (Mistral AI)
    assert abs(mixtral.num_params / 1e9 - 46.7) < 0.1 and abs(mixtral.active_params / 1e9 - 12.9) < 0.1
    qwen = preset("qwen3-30b-a3b")  # 30.5B total, 3.3B active (Qwen3 report)
    assert abs(qwen.num_params / 1e9 - 30.5) < 0.1 and abs(qwen.active_params / 1e9 - 3.3) < 0.1


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="arch"):
        ModelConfig(arch="llama")
    with pytest.raises(ValueError, match="overlap_chunks"):
        ModelConfig(overlap_chunks=0)
    with pytest.raises(ValueError, match="preset"):
        preset("huge")


def test_rope_is_a_rotation_that_depends_only_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 2, 16, generator=gen, dtype=torch.float64), torch.randn(1, 1, 2, 16, generator=gen, dtype=torch.float64)
    def score(i, j):
        cq, sq = rope_tables(torch.tensor([i]), 16, 10000.0, torch.float64)
        ck, sk = rope_tables(torch.tensor([j]), 16, 10000.0, torch.float64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum(-1)
    assert torch.allclose(score(7, 3), score(104, 100), atol=1e-5)
    cos, sin = rope_tables(torch.tensor([5]), 16, 10000.0, torch.float64)
    assert torch.allclose(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1))


@pytest.mark.parametrize("scaling", [{}, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                      "mscale": 1.0, "mscale_all_dim": 0.5},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_tables_from_frequencies_computed_before_are_the_same(scaling):
    """A compiled decode step passes the frequencies in (``rope_frequencies``): the same tables, YaRN's factor too."""
    positions = torch.tensor([0, 3, 17, 500, 70001])
    freqs, factor = inv_freq(24, 1e4, scaling)
    assert factor == attention_factor(scaling) and (factor != 1.0) == (scaling.get("rope_type") == "yarn")
    for got, want in zip(rope_tables(positions, 24, 1e4, torch.float32, scaling, freqs=freqs),
                         rope_tables(positions, 24, 1e4, torch.float32, scaling)):
        assert torch.equal(got, want) and not torch.equal(got, torch.zeros_like(got))


def test_model_is_causal_and_generate_continues_its_own_argmax():
    model = MoETransformer(preset("tiny")).double()
    model.init_weights(3, std=0.1)
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(4))
    logits = model(ids)
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 128
    assert torch.allclose(model(changed)[:, :12], logits[:, :12], atol=1e-12)  # the future is invisible
    out = generate(model, ids, 3, return_logits=True)
    assert torch.allclose(out.logits[:, 0], logits[:, -1].float(), atol=1e-5)
    extended = torch.cat([ids, out.tokens[:, :2]], dim=1)
    assert torch.equal(model(extended)[:, -3:].argmax(-1), out.tokens)


def test_bad_input_is_named():
    model = MoETransformer(preset("tiny"))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.full((1, 4), 128))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.zeros(1, 4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, torch.zeros(4, dtype=torch.int64), 2)
