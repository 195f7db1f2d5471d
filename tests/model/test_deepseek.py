"""DeepSeek-V3 (multi-head latent attention, dense first layers, shared experts, the sigmoid group-limited
router, YaRN with its mscale) from checkpoints written by transformers: logits at float64, greedy tokens and
every decoding step's logits, on one process and on meshes."""

from __future__ import annotations

import logging

import pytest
import torch

from ringmoe.model import load_checkpoint
from ringmoe.parallel.launch import spawn
from tests.helpers import MESH_VOCAB, assert_generation_matches, assert_mesh_matches, mesh_rank_run

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, SEQ = MESH_VOCAB, 29
VARIANTS = {
    "q-lora": dict(q_lora_rank=16),
    "no-q-lora": dict(q_lora_rank=None),
    "yarn": dict(q_lora_rank=16, max_position_embeddings=64,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                  "rope_theta": 1e4}),
}


def _save(variant: str, path, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1, n_group=2, topk_group=1,
        n_shared_experts=1, initializer_range=0.2, attn_implementation="eager", experts_implementation="eager",
        **VARIANTS[variant])
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers[1:]:  # a selection bias that changes the choice
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return model.double().eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_tokens_and_decoding_match_transformers(variant, tmp_path):
    hf = _save(variant, tmp_path)
    ours = load_checkpoint(tmp_path, dtype=torch.float64)
    assert ours.config.mla and ours.config.dense_layers == (0,)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    # transformers routes (sigmoid scores) and turns RoPE in float32: agreement to float32 resolution
    assert_generation_matches(hf, ours, ids, 5, 1e-5, 1e-5)


@pytest.mark.parametrize("cp,ep,mla_ring", [(2, 1, "latent"), (2, 1, "expanded"), (1, 2, "auto"), (2, 2, "latent")])
def test_meshes_match_transformers(cp, ep, mla_ring, tmp_path):
    hf = _save("q-lora", tmp_path, seed=4)
    results = spawn(mesh_rank_run, cp * ep, str(tmp_path), cp, ep, 3, mla_ring, timeout=180)
    assert_mesh_matches(hf, results, cp, ep, 3, logits_tol=1e-5)
