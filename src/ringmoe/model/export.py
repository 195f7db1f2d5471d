"""Writing a model as a transformers checkpoint: config.json and model.safetensors in transformers' names.

The inverse of ``checkpoint.load_checkpoint`` for one process holding every expert: experts are
written as ``save_pretrained`` writes them (per expert: ``block_sparse_moe.experts.{e}.w1/w2/w3`` for
Mixtral, ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` for Qwen3-MoE, Qwen2-MoE and OLMoE; fused for
gpt-oss: ``experts.gate_up_proj`` (E, H, 2F) with gate and up interleaved, ``down_proj`` (E, F, H) and
their biases), so transformers' *ForCausalLM of the family loads the folder as is.  A model loaded from a
quantized checkpoint is written in its format (fp8 codes with ``weight_scale_inv``; mxfp4 ``*_blocks`` and
``*_scales``) with its ``quantization_config``.  DeepSeek-V3's multi-token prediction modules are written as the
layers past the last, with the copies of the embedding and head its checkpoints carry (``num_nextn_predict_layers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..moe.quantized_experts import QuantizedSwiGLUExperts
from ..quant import QuantizedLinear, QuantizedWeight
from .config import ModelConfig
from .transformer import MoETransformer

__all__ = ["config_to_hf", "save_pretrained"]


def _rope(config: ModelConfig) -> dict:
    scaling = dict(config.rope_scaling) or {"rope_type": "default"}
    return {"rope_theta": config.rope_theta, "rope_parameters": {"rope_theta": config.rope_theta, **scaling}}


def _window(config: ModelConfig) -> dict:
    if config.sliding_window is None:
        return {"sliding_window": None, "use_sliding_window": False}
    types = config.layer_types or ("sliding_attention",) * config.num_layers
    return {"sliding_window": config.sliding_window, "use_sliding_window": True, "layer_types": list(types),
            "max_window_layers": 0}


def config_to_hf(config: ModelConfig, eos_token_id: int | None = None, bos_token_id: int | None = None) -> dict:
    """transformers' config.json dict for ``config`` (the inverse of ``config_from_hf``)."""
    common = {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "num_experts_per_tok": config.top_k, "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
        "max_position_embeddings": 131072, "attention_dropout": 0.0, "eos_token_id": eos_token_id,
        "bos_token_id": bos_token_id, "torch_dtype": "float32", **_rope(config), **_window(config),
    }
    arch = config.arch
    if arch == "mixtral":
        if not config.normalize_topk:
            raise ValueError("Mixtral renormalises its top-k weights: normalize_topk must be True")
        return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": config.ffn_size, "num_local_experts": config.num_experts, "router_jitter_noise": 0.0}
    if arch == "gpt_oss":
        return {**common, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "intermediate_size": config.ffn_size, "num_local_experts": config.num_experts,
                "attention_bias": config.qkv_bias, "swiglu_limit": config.swiglu_limit, "router_aux_loss_coef": 0.0}
    if arch == "deepseek_v3":
        if config.router != "sigmoid_bias" or config.shared_gated:
            raise ValueError("DeepSeek-V3 routes by sigmoid scores with a selection bias and ungated shared experts")
        first_dense = len(config.dense_layers)
        if config.dense_layers != tuple(range(first_dense)):
            raise ValueError("DeepSeek-V3's dense layers are the first ones (first_k_dense_replace)")
        return {**common, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                "head_dim": config.qk_rope_head_dim, "qk_head_dim": config.head_dim,
                "moe_intermediate_size": config.ffn_size, "intermediate_size": config.dense_ffn_size or config.ffn_size,
                "n_routed_experts": config.num_experts, "n_shared_experts": config.shared_ffn_size // config.ffn_size,
                "first_k_dense_replace": first_dense, "norm_topk_prob": config.normalize_topk,
                "n_group": config.n_group, "topk_group": config.topk_group,
                "routed_scaling_factor": config.routed_scaling_factor, "kv_lora_rank": config.kv_lora_rank,
                "q_lora_rank": config.q_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
                "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim,
                "rope_interleave": config.rope_interleave, "attention_bias": False,
                "num_nextn_predict_layers": config.mtp_layers}
    if arch == "olmoe":
        return {**common, "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
                "intermediate_size": config.ffn_size, "num_experts": config.num_experts,
                "norm_topk_prob": config.normalize_topk, "clip_qkv": None, "attention_bias": False}
    qwen = {"moe_intermediate_size": config.ffn_size, "intermediate_size": config.dense_ffn_size or config.ffn_size,
            "num_experts": config.num_experts, "norm_topk_prob": config.normalize_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": list(config.dense_layers)}
    if arch == "qwen3_moe":
        return {**common, **qwen, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "attention_bias": False}
    if not config.shared_ffn_size or not config.shared_gated:
        raise ValueError("Qwen2-MoE has a gated shared expert: shared_ffn_size must be > 0 and shared_gated True")
    return {**common, **qwen, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "qkv_bias": config.qkv_bias, "shared_expert_intermediate_size": config.shared_ffn_size}


def _interleave(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """gate, up (..., F, ...) -> (..., 2F, ...) along ``dim`` with gate at even and up at odd indices."""
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _fp8(name: str, weight: QuantizedWeight, index: int | None = None) -> dict[str, torch.Tensor]:
    """An fp8 weight as the checkpoint stores it: ``name`` the e4m3 codes, ``name``_scale_inv the block scales."""
    codes, scales = (weight.codes, weight.scales) if index is None else (weight.codes[index], weight.scales[index])
    return {name: codes.view(torch.float8_e4m3fn), f"{name}_scale_inv": scales.view(torch.float32)}


def _linear(name: str, module) -> dict[str, torch.Tensor]:
    """A linear layer's weight ``name``: float, or its fp8 codes and scales."""
    return _fp8(name, module.weight_q) if isinstance(module, QuantizedLinear) else {name: module.weight}


def _quantized_expert_tensors(config: ModelConfig, prefix: str, experts) -> dict[str, torch.Tensor]:
    """Quantized experts kept in their format: fp8 per expert with block scales; mxfp4 fused as gpt-oss ships
    them (``gate_up_proj_blocks/_scales`` with gate and up rows interleaved, ``down_proj_blocks/_scales``)."""
    out = {}
    if experts.scheme.method == "mxfp4":
        for kind, (gate, up) in (("blocks", (experts.gate_q.codes, experts.up_q.codes)),
                                 ("scales", (experts.gate_q.scales, experts.up_q.scales))):
            out[f"{prefix}.experts.gate_up_proj_{kind}"] = _interleave(gate, up, 1)
        out[f"{prefix}.experts.down_proj_blocks"] = experts.down_q.codes
        out[f"{prefix}.experts.down_proj_scales"] = experts.down_q.scales
    else:
        names = ("w1", "w3", "w2") if config.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(config.num_experts):
            for role, weight in zip(names, (experts.gate_q, experts.up_q, experts.down_q)):
                out.update(_fp8(f"{prefix}.experts.{e}.{role}.weight", weight, e))
    if experts.gate_up_bias is not None:
        f = config.ffn_size
        bias = experts.gate_up_bias
        out[f"{prefix}.experts.gate_up_proj_bias"] = _interleave(bias[:, :f], bias[:, f:], 1)
        out[f"{prefix}.experts.down_proj_bias"] = experts.down_bias
    return out


def _expert_tensors(config: ModelConfig, prefix: str, experts) -> dict[str, torch.Tensor]:
    """One MoE layer's experts in the family's checkpoint names and layouts."""
    if isinstance(experts, QuantizedSwiGLUExperts):
        return _quantized_expert_tensors(config, prefix, experts)
    f = config.ffn_size
    gate, up, down = experts.gate_up[:, :f], experts.gate_up[:, f:], experts.down
    if config.arch == "gpt_oss":
        out = {f"{prefix}.experts.gate_up_proj": _interleave(gate, up, 1).transpose(1, 2),   # (E, H, 2F)
               f"{prefix}.experts.down_proj": down.transpose(1, 2)}                            # (E, F, H)
        if experts.gate_up_bias is not None:
            bias = experts.gate_up_bias
            out[f"{prefix}.experts.gate_up_proj_bias"] = _interleave(bias[:, :f], bias[:, f:], 1)
            out[f"{prefix}.experts.down_proj_bias"] = experts.down_bias
        return out
    names = ("w1", "w3", "w2") if config.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for e in range(config.num_experts):
        out[f"{prefix}.experts.{e}.{names[0]}.weight"] = gate[e]
        out[f"{prefix}.experts.{e}.{names[1]}.weight"] = up[e]
        out[f"{prefix}.experts.{e}.{names[2]}.weight"] = down[e]
    return out


def _tensors(model: MoETransformer) -> dict[str, torch.Tensor]:
    config = model.config
    moe = "block_sparse_moe" if config.arch == "mixtral" else "mlp"
    router = "router" if config.arch == "gpt_oss" else "gate"
    out = {}
    for name, param in model.state_dict().items():
        parts = name.split(".")
        if parts[0] in ("layers", "mtp_layers") and model.decoder_layer(int(parts[1])).is_moe and parts[2] == "mlp":
            continue  # MoE blocks below, in the family's names
        if name.endswith(".weight_q.scales"):
            continue  # with its codes
        hf_name = name.removeprefix("mtp_")  # an MTP module is the checkpoint's layer past the last
        if name.endswith(".weight_q.codes"):
            module = name.removesuffix(".weight_q.codes")
            weight = model.get_submodule(module).weight_q
            out.update(_fp8(f"model.{hf_name.removesuffix('.weight_q.codes')}.weight", weight))
            continue
        out[name if name == "lm_head.weight" else f"model.{hf_name}"] = param
    for index in model.mtp_layers:  # DeepSeek-V3's MTP layers carry copies of the shared embedding and head
        out[f"model.layers.{index}.embed_tokens.weight"] = model.embed_tokens.weight
        out[f"model.layers.{index}.shared_head.head.weight"] = model.lm_head.weight
    for index, layer in model.moe_layers(with_mtp=True):
        prefix = f"model.layers.{index}.{moe}"
        out[f"{prefix}.{router}.weight"] = layer.mlp.router.weight
        if config.arch == "deepseek_v3":
            out[f"{prefix}.gate.e_score_correction_bias"] = layer.mlp.router.correction_bias
        if layer.mlp.router.bias is not None:
            out[f"{prefix}.{router}.bias"] = layer.mlp.router.bias
        out.update(_expert_tensors(config, prefix, layer.mlp.experts))
        shared = layer.mlp.shared
        if shared is not None:
            shared_name = "shared_experts" if config.arch == "deepseek_v3" else "shared_expert"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out.update(_linear(f"{prefix}.{shared_name}.{proj}.weight", getattr(shared, proj)))
            if shared.gate is not None:
                out[f"{prefix}.shared_expert_gate.weight"] = shared.gate.weight
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
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):  # kept in the format it was loaded in
        config["quantization_config"] = model.config.quantization.to_hf()
    weights = path / "model.safetensors.tmp"
    save_file(_tensors(model), str(weights), metadata={"format": "pt"})
    (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    weights.replace(path / "model.safetensors")
    (path / "config.json.tmp").replace(path / "config.json")
    return path
