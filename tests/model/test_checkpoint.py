"""Checkpoints written by transformers' save_pretrained load into MoETransformer with the same logits."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from ringmoe.model import config_from_hf, load_checkpoint, load_config
from ringmoe.parallel import make_mesh, shard
from ringmoe.parallel.launch import spawn
from tests.helpers import assert_generation_matches

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, SEQ = 96, 29


def _save(kind: str, path, seed: int = 0, **save_kwargs):
    """A tiny random transformers model of ``kind`` saved under ``path``; returns it (float64, eager)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  experts_implementation="eager", attn_implementation="eager", initializer_range=0.1)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=40, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                                          head_dim=16, norm_topk_prob=kind.endswith("norm"), **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # RMSNorm weights are 1 at init: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **save_kwargs)
    return model.double().eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3", "qwen3-norm"])
def test_logits_and_greedy_tokens_match_transformers(kind, tmp_path):
    hf = _save(kind, tmp_path)
    ours = load_checkpoint(tmp_path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    # transformers computes RoPE angles and router softmax in float32 (so does ringmoe's RoPE)
    hf.generation_config.eos_token_id = None  # the whole length, as ringmoe's generate here
    assert_generation_matches(hf, ours, ids, 5, 1e-6, 1e-5)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    hf = _save("mixtral", tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_checkpoint(tmp_path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-6


def _per_rank_load(rank, world, path, cp, ep):
    mesh = make_mesh(cp, ep)
    model = load_checkpoint(path, mesh, dtype=torch.float64)
    own = set(model.layers[0].mlp.slot_experts)
    read_experts = {int(m.group(1)) for name in model.load_report.tensors
                    if (m := re.search(r"experts\.(\d+)\.", name))}
    assert read_experts == own, f"rank {rank} read experts {read_experts}, holds {own}"
    ids = torch.randint(0, VOCAB, (2 * ep, 28), generator=torch.Generator().manual_seed(3))
    rows = ids[mesh.batch_rows(ids.shape[0])]
    local = shard(rows, cp, mesh.cp_rank, "zigzag", dim=1) if cp > 1 else rows
    return model(local).tolist(), local.tolist(), rows.tolist()


@pytest.mark.parametrize("cp,ep", [(1, 2), (2, 2)])
def test_each_rank_reads_only_its_experts_and_matches_transformers(tmp_path, cp, ep):
    hf = _save("qwen3", tmp_path, seed=4)
    for rank, (logits, local, rows) in enumerate(spawn(_per_rank_load, cp * ep, str(tmp_path), cp, ep, timeout=120)):
        cp_rank = rank // ep
        with torch.no_grad():
            want = hf(torch.tensor(rows)).logits
        want = shard(want, cp, cp_rank, "zigzag", dim=1) if cp > 1 else want
        assert (torch.tensor(logits, dtype=torch.float64) - want).abs().max() < 1e-6


def test_refuses_pickles_and_reports_what_is_missing(tmp_path):
    _save("mixtral", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="nowhere' does not exist"):
        load_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no config.json"):
        load_config(tmp_path / "..")


def test_config_from_hf_rejects_what_is_not_implemented():
    base = dict(model_type="mixtral", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_experts_per_tok=1, intermediate_size=4, num_local_experts=2)
    assert config_from_hf(base).head_dim == 4
    assert config_from_hf({**base, "sliding_window": 4096}).window(0) == (4095, 0)
    with pytest.raises(ValueError, match="RoPE scaling 'dynamic'"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    with pytest.raises(ValueError, match="needs a positive original_max_position_embeddings"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match="clip_qkv"):
        config_from_hf({**base, "model_type": "olmoe", "num_experts": 2, "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({**base, "model_type": "llama"})
