"""Writing a model as a transformers checkpoint: config.json and model.safetensors in transformers' names.

The inverse of ``checkpoint.load_checkpoint`` for one process holding every expert: experts are
written per expert (``block_sparse_moe.experts.{e}.w1/w2/w3`` for Mixtral,
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` for Qwen3-MoE), as ``save_pretrained`` writes them,
so transformers' MixtralForCausalLM / Qwen3MoeForCausalLM load the folder as is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .transformer import MoETransformer

__all__ = ["config_to_hf", "save_pretrained"]


def config_to_hf(config: ModelConfig, eos_token_id: int | None = None, bos_token_id: int | None = None) -> dict:
    """transformers' config.json dict for ``config`` (the inverse of ``config_from_hf``)."""
    common = {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "num_experts_per_tok": config.top_k, "rms_norm_eps": config.rms_eps,
        "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
        "max_position_embeddings": 131072, "attention_dropout": 0.0, "eos_token_id": eos_token_id,
        "bos_token_id": bos_token_id, "torch_dtype": "float32",
    }
    if config.arch == "mixtral":
        if not config.normalize_topk:
            raise ValueError("Mixtral renormalises its top-k weights: normalize_topk must be True")
        return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": config.ffn_size, "num_local_experts": config.num_experts,
                "sliding_window": None, "router_jitter_noise": 0.0}
    return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": config.ffn_size, "intermediate_size": config.ffn_size,
            "num_experts": config.num_experts, "norm_topk_prob": config.normalize_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None, "attention_bias": False}


def _tensors(model: MoETransformer) -> dict[str, torch.Tensor]:
    config = model.config
    mixtral = config.arch == "mixtral"
    moe, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    out = {}
    for name, param in model.state_dict().items():
        if ".mlp." not in name:
            out[name if name == "lm_head.weight" else f"model.{name}"] = param
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}.{moe}"
        out[f"{prefix}.gate.weight"] = layer.mlp.router.weight
        gate_up, down = layer.mlp.experts.gate_up, layer.mlp.experts.down
        ffn = config.ffn_size
        for e in range(config.num_experts):
            out[f"{prefix}.experts.{e}.{names[0]}.weight"] = gate_up[e, :ffn]
            out[f"{prefix}.experts.{e}.{names[1]}.weight"] = gate_up[e, ffn:]
            out[f"{prefix}.experts.{e}.{names[2]}.weight"] = down[e]
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


@torch.no_grad()
def save_pretrained(model: MoETransformer, path: str | Path, eos_token_id: int | None = None,
                    bos_token_id: int | None = None) -> Path:
    """Write ``model`` (one process: every expert) to ``path`` as transformers would; returns the folder.

    The files are written under temporary names and renamed, so a reader never sees half a checkpoint.
    """
    from safetensors.torch import save_file

    if model.mesh.size != 1:
        raise ValueError("save_pretrained needs the whole model on one process (mesh 1 x 1)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(model.config, eos_token_id, bos_token_id)
    config["torch_dtype"] = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    weights = path / "model.safetensors.tmp"
    save_file(_tensors(model), str(weights), metadata={"format": "pt"})
    (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    weights.replace(path / "model.safetensors")
    (path / "config.json.tmp").replace(path / "config.json")
    return path
