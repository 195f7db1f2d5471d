"""DeepSeek-V3 (multi-head latent attention, dense first layers, shared experts, the sigmoid group-limited
router, YaRN with its mscale) from checkpoints written by transformers: logits at float64, greedy tokens and
every decoding step's logits, on one process and on meshes."""

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
    with torch.no_grad():
        want = hf(ids).logits
    # transformers routes (sigmoid scores) and turns RoPE in float32: agreement to float32 resolution
    assert (ours(ids) - want).abs().max() < 1e-5, (ours(ids) - want).abs().max()
    hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                            pad_token_id=0)[:, SEQ:]
    run = generate(ours, ids, 5, return_logits=True)
    assert torch.equal(run.tokens, hf_tokens)
    with torch.no_grad():
        teacher = hf(torch.cat([ids, run.tokens], dim=1)).logits[:, SEQ - 1:-1]
    assert (run.logits - teacher).abs().max() < 1e-5


def _mesh(rank, world, path, cp, ep, mla_ring):
    mesh = make_mesh(cp, ep)
    model = load_checkpoint(path, mesh, dtype=torch.float64)
    model.mla_ring = mla_ring
    ids = torch.randint(0, VOCAB, (2 * ep, 28), generator=torch.Generator().manual_seed(3))
    rows = ids[mesh.batch_rows(ids.shape[0])]
    local = shard(rows, cp, mesh.cp_rank, "zigzag", dim=1) if cp > 1 else rows
    run = generate(model, ids, 3, return_logits=True)
    return model(local).tolist(), rows.tolist(), run.tokens.tolist(), run.logits.tolist()


@pytest.mark.parametrize("cp,ep,mla_ring", [(2, 1, "latent"), (2, 1, "expanded"), (1, 2, "auto"), (2, 2, "latent")])
def test_meshes_match_transformers(cp, ep, mla_ring, tmp_path):
    hf = _save("q-lora", tmp_path, seed=4)
    ids = torch.randint(0, VOCAB, (2 * ep, 28), generator=torch.Generator().manual_seed(3))
    for rank, (logits, rows, tokens, steps) in enumerate(spawn(_mesh, cp * ep, str(tmp_path), cp, ep, mla_ring,
                                                                         timeout=180)):
        with torch.no_grad():
            want = hf(torch.tensor(rows)).logits
            teacher = hf(torch.cat([ids, torch.tensor(tokens)], dim=1)).logits[:, 27:-1]
        want = shard(want, cp, rank // ep, "zigzag", dim=1) if cp > 1 else want
        assert (torch.tensor(logits, dtype=torch.float64) - want).abs().max() < 1e-5, f"rank {rank}"
        assert (torch.tensor(steps, dtype=torch.float64) - teacher).abs().max() < 1e-5, f"rank {rank}"
