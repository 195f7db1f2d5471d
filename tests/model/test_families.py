"""The other common MoE families, from checkpoints written by transformers' save_pretrained: Qwen3-MoE with
dense layers, Qwen2-MoE (shared expert with its gate, q/k/v biases), OLMoE (qk-norm over the whole
projection), gpt-oss (attention sinks, alternating sliding-window / full layers, biases, clamped SwiGLU,
top-k-then-softmax router, YaRN) and Mixtral with linear and Llama-3 RoPE scaling.  Logits against
transformers at float64 (which computes RoPE and routing in float32), greedy tokens, and the meshes."""

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
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.1, attn_implementation="eager", experts_implementation="eager")


def _build(family: str):
    if family == "qwen3-dense":
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=16,
                                          intermediate_size=56, mlp_only_layers=[0], norm_topk_prob=True, **COMMON)
        return transformers.Qwen3MoeForCausalLM(cfg)
    if family == "qwen3-sparse-step":
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=16,
                                          intermediate_size=56, decoder_sparse_step=2, **COMMON)
        return transformers.Qwen3MoeForCausalLM(cfg)
    if family == "qwen2":
        cfg = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                                          shared_expert_intermediate_size=24, intermediate_size=48,
                                          mlp_only_layers=[1], **COMMON)
        return transformers.Qwen2MoeForCausalLM(cfg)
    if family == "olmoe":
        cfg = transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=40, **COMMON)
        return transformers.OlmoeForCausalLM(cfg)
    if family == "gpt-oss":
        cfg = transformers.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=40, head_dim=8,
                                        sliding_window=5, swiglu_limit=1.5, **COMMON)
        return transformers.GptOssForCausalLM(cfg)
    rope = {"mixtral-linear": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4},
            "mixtral-llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16, "rope_theta": 5e5},
            "mixtral-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "rope_theta": 1e4}}[family]
    cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=40,
                                     rope_parameters=rope, max_position_embeddings=64, head_dim=8, **COMMON)
    return transformers.MixtralForCausalLM(cfg)


FAMILIES = ["qwen3-dense", "qwen3-sparse-step", "qwen2", "olmoe", "gpt-oss", "mixtral-linear", "mixtral-llama3",
            "mixtral-yarn"]


def _save(family: str, path, seed: int = 0):
    torch.manual_seed(seed)
    model = _build(family)
    with torch.no_grad():  # make every weight matter: norms away from 1, biases and sinks away from 0
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None  # greedy for the whole length, as ringmoe's generate here
    model.save_pretrained(path)
    return model.double().eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(family, tmp_path):
    hf = _save(family, tmp_path)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    assert_generation_matches(hf, load_checkpoint(tmp_path, dtype=torch.float64), ids, 5, 1e-6, 1e-6)


@pytest.mark.parametrize("family", ["qwen2", "olmoe", "gpt-oss", "qwen3-dense"])
@pytest.mark.parametrize("cp,ep", [(2, 1), (1, 2), (2, 2)])
def test_meshes_match_transformers(family, cp, ep, tmp_path):
    hf = _save(family, tmp_path, seed=4)
    results = spawn(mesh_rank_run, cp * ep, str(tmp_path), cp, ep, 4, timeout=180)
    assert_mesh_matches(hf, results, cp, ep, 4, logits_tol=1e-6)
