"""A ringmoe model written by save_pretrained loads in transformers (same logits) and back in ringmoe."""

from __future__ import annotations

import logging

import pytest
import torch

from ringmoe.model import MoETransformer, load_checkpoint, preset, save_pretrained

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


CONFIGS = {"mixtral": preset("tiny"), "qwen3_moe": preset("tiny").replace(arch="qwen3_moe", qk_norm=True),
           "gpt-oss": preset("gpt-oss-tiny"), "qwen2-moe": preset("qwen2-moe-tiny"), "olmoe": preset("olmoe-tiny"),
           "qwen3-moe-dense": preset("qwen3-moe-dense-tiny"), "deepseek_v3": preset("deepseek-v3-tiny")}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_exported_checkpoint_loads_in_transformers_with_equal_logits(arch, tmp_path):
    config = CONFIGS[arch]
    model = MoETransformer(config).double()
    model.init_weights(11, std=0.2)
    with torch.no_grad():  # norms away from 1 so they matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    save_pretrained(model, tmp_path, eos_token_id=0)
    assert not list(tmp_path.glob("*.tmp"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    ids = torch.randint(0, config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2))
    assert type(hf).__name__.lower().startswith(arch.split("_")[0].replace("-", "").split("moe")[0])
    with torch.no_grad():
        want = hf(ids).logits
    # transformers computes RoPE angles and the router softmax in float32: agreement to float32 resolution
    assert (model(ids) - want).abs().max() < 1e-5
    again = load_checkpoint(tmp_path, dtype=torch.float64)
    assert torch.equal(again(ids), model(ids))
