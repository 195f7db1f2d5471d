"""The other common MoE families, from checkpoints written by transformers' save_pretrained: Qwen3-MoE with
dense layers, Qwen2-MoE (shared expert with its gate, q/k/v biases), OLMoE (qk-norm over the whole
projection), gpt-oss (attention sinks, alternating sliding-window / full layers, biases, clamped SwiGLU,
top-k-then-softmax router, YaRN) and Mixtral with linear and Llama-3 RoPE scaling.  Logits against
transformers at float64 (which computes RoPE and routing in float32), greedy tokens, and the meshes."""

from __future__ import annotations

import logging

import pytest
import torch

from ringmoe.model import generate, load_checkpoint
from ringmoe.parallel import make_mesh, shard
from ringmoe.parallel.launch import spawn

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, SEQ = 96, 29
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
    ours = load_checkpoint(tmp_path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    got = ours(ids)
    assert (got - want).abs().max() < 1e-6, (got - want).abs().max()
    hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                            pad_token_id=0)[:, SEQ:]
    run = generate(ours, ids, 5, return_logits=True)
    assert torch.equal(run.tokens, hf_tokens)
    with torch.no_grad():  # every decoding step's logits (paged cache, windows, sinks) against the full recompute
        teacher = hf(torch.cat([ids, run.tokens], dim=1)).logits[:, SEQ - 1:-1]
    assert (run.logits - teacher).abs().max() < 1e-6, (run.logits - teacher).abs().max()


def _mesh_logits(rank, world, path, cp, ep):
    mesh = make_mesh(cp, ep)
    model = load_checkpoint(path, mesh, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2 * ep, 28), generator=torch.Generator().manual_seed(3))
    rows = ids[mesh.batch_rows(ids.shape[0])]
    local = shard(rows, cp, mesh.cp_rank, "zigzag", dim=1) if cp > 1 else rows
    run = generate(model, ids, 4, return_logits=True)
    return model(local).tolist(), rows.tolist(), run.tokens.tolist(), run.logits.tolist()


@pytest.mark.parametrize("family", ["qwen2", "olmoe", "gpt-oss", "qwen3-dense"])
@pytest.mark.parametrize("cp,ep", [(2, 1), (1, 2), (2, 2)])
def test_meshes_match_transformers(family, cp, ep, tmp_path):
    hf = _save(family, tmp_path, seed=4)
    ids = torch.randint(0, VOCAB, (2 * ep, 28), generator=torch.Generator().manual_seed(3))
    want_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              pad_token_id=0)[:, 28:]
    for rank, (logits, rows, tokens, steps) in enumerate(spawn(_mesh_logits, cp * ep, str(tmp_path), cp, ep,
                                                              timeout=180)):
        with torch.no_grad():
            want = hf(torch.tensor(rows)).logits
            teacher = hf(torch.cat([ids, torch.tensor(tokens)], dim=1)).logits[:, 27:-1]
        want = shard(want, cp, rank // ep, "zigzag", dim=1) if cp > 1 else want
        assert (torch.tensor(logits, dtype=torch.float64) - want).abs().max() < 1e-6, f"rank {rank}"
        assert torch.equal(torch.tensor(tokens), want_tokens), f"rank {rank}"
        assert (torch.tensor(steps, dtype=torch.float64) - teacher).abs().max() < 1e-5, f"rank {rank}: decode logits"
